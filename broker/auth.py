"""Bearer tokens: minted once, stored as salted scrypt hashes, verified in constant time."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from gpubroker.client import Unauthenticated

from .config import BrokerConfig, TenantConfig

__all__ = ["NewToken", "TokenVerifier", "hash_token", "mint_token"]

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
