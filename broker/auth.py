"""Bearer tokens: minted once, stored as salted scrypt hashes, verified in constant time."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpubroker.client import PermissionDenied, Unauthenticated

from .config import BrokerConfig, TenantConfig

__all__ = ["Authenticator", "NewToken", "Principal", "TokenVerifier", "hash_token", "mint_token"]

_TOKEN_PREFIX = "gpb"
# scrypt at N=2**14 costs ~15-40 ms: slow enough against guessing, cached after the first use.
_SCRYPT = {"n": 2**14, "r": 8, "p": 1}
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_token(secret: str, salt: bytes | None = None) -> str:
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, dklen=32, **_SCRYPT)
    return f"scrypt${_SCRYPT['n']}${_SCRYPT['r']}${_SCRYPT['p']}${_b64(salt)}${_b64(digest)}"


def _check_hash(secret: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        got = hashlib.scrypt(secret.encode(), salt=_unb64(salt), n=int(n), r=int(r), p=int(p), dklen=32)
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, _unb64(digest))


@dataclass(frozen=True)
class NewToken:
    token: str
    token_id: str
    token_hash: str


def mint_token() -> NewToken:
    """A token is ``gpb_<id>_<secret>``: the id finds the tenant, the 256-bit secret proves it."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return NewToken(f"{_TOKEN_PREFIX}_{token_id}_{secret}", token_id, hash_token(secret))


class TokenVerifier:
    """Maps a presented token to its tenant, or raises Unauthenticated with one fixed message."""

    def __init__(self, config: BrokerConfig) -> None:
        self.reload(config)

    @property
    def known_ids(self) -> set[str]:
        return set(self._by_id)

    def reload(self, config: BrokerConfig) -> None:
        self._by_id: dict[str, TenantConfig] = {t.token_id: t for t in config.tenants.values()}
        # sha256(token) -> tenant name, so only the first call pays for scrypt.
        self._verified: dict[bytes, str] = {}

    def tenant_for(self, token: str | None) -> str:
        if token:
            key = hashlib.sha256(token.encode()).digest()
            cached = self._verified.get(key)
            if cached is not None:
                return cached
            parts = token.split("_", 2)
            if len(parts) == 3 and parts[0] == _TOKEN_PREFIX:
                tenant = self._by_id.get(parts[1])
                if tenant is not None and _check_hash(parts[2], tenant.token_hash):
                    self._verified[key] = tenant.name
                    return tenant.name
        raise Unauthenticated(UNAUTHENTICATED_MESSAGE)

    @staticmethod
    def token_from_metadata(metadata: object) -> str | None:
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                return value[len("Bearer "):].strip()
        return None


audit = logging.getLogger("gpubroker.audit")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant, proven by a token or a client certificate."""

    tenant: str
    admin: bool
    via: str  # "token" or "certificate"

    def require_admin(self, action: str) -> None:
        if not self.admin:
            audit.warning("denied: tenant=%s action=%s (not an admin)", self.tenant, action)
            raise PermissionDenied(f"{action} needs an admin identity")


def certificate_identities(auth_context: Mapping[str, Sequence[bytes]]) -> list[str]:
    """A verified client certificate's SAN URIs, then its CN (gRPC puts them in the auth context)."""
    names = [v.decode() for v in auth_context.get("x509_subject_alternative_name", ()) if b"://" in v]
    names += [v.decode() for v in auth_context.get("x509_common_name", ())]
    return names


class Authenticator:
    """Turns a call's credentials into a Principal; every failure gets the same UNAUTHENTICATED message."""

    def __init__(self, config: BrokerConfig) -> None:
        self.tokens = TokenVerifier(config)
        self.reload(config)

    def reload(self, config: BrokerConfig) -> None:
        self.config = config
        self.tokens.reload(config)

    def authenticate(self, metadata: object, auth_context: Mapping[str, Sequence[bytes]], peer: str,
                     method: str = "") -> Principal:
        tls = self.config.tls
        identities = certificate_identities(auth_context) if tls is not None else []
        for identity in identities:
            name = tls.identities.get(identity, identity) if tls is not None else identity
            tenant = self.config.tenants.get(name)
            if tenant is not None:
                return Principal(tenant.name, tenant.admin, "certificate")
        if tls is not None and identities and not tls.allow_tokens:
            audit.warning("auth failure: peer=%s method=%s certificate=%s maps to no tenant", peer, method,
                          identities)
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        token = TokenVerifier.token_from_metadata(metadata)
        try:
            name = self.tokens.tenant_for(token)
        except Unauthenticated:
            token_id = token.split("_", 2)[1] if token and token.count("_") >= 2 else "-"
            audit.warning("auth failure: peer=%s method=%s token_id=%s", peer, method,
                          token_id if token_id in self.tokens.known_ids else "unknown")
            raise
        tenant = self.config.tenants[name]
        return Principal(tenant.name, tenant.admin, "token")
