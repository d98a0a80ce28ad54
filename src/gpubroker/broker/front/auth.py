"""Bearer tokens: minted once, stored as keyed hashes, verified in constant time at the same cost either way.

A token is ``gpb_<id>_<secret>`` with a 256-bit random secret. Such a secret cannot be guessed, so it needs no slow
password hash: new tokens are stored as HMAC-SHA256 under a per-token random key (``hmac-sha256$key$digest``),
which costs about a microsecond to check, right or wrong, and an unknown id is checked against a dummy entry so
that timing does not say whether an id exists. Entries from older brokers (salted scrypt) keep working until
rotated, but scrypt never runs on the event loop: ``prepare`` checks them in a worker thread, a few at a time,
and remembers only successes. A peer whose checks fail has its failing replies delayed, longer with each failure
(``FailurePenalty``), while everyone else is served as before.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import functools
import hashlib
import hmac
import itertools
import logging
import secrets
import socket
import ssl
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpubroker.broker.config import BrokerConfig, TenantConfig
from gpubroker.wire.addresses import AddressError, parse_host_port
from gpubroker.wire.errors import PermissionDenied, Unauthenticated, Unavailable

__all__ = ["AUTH_FAILURE_KINDS", "REVOKED_CALL_MESSAGE", "Authenticator", "FailurePenalty", "NewToken", "Principal",
           "RateLimitedLog", "Revocations", "TokenVerifier", "hash_token", "mint_token", "peer_credentials",
           "peer_key", "wait_failure_delay"]

_TOKEN_PREFIX = "gpb"
_HMAC = "hmac-sha256"
_KEY_BYTES = 32
# Legacy entries only: scrypt at N=2**14 costs ~15-40 ms, so it runs in threads, this many at once, and callers
# beyond the queue are told to retry rather than waiting behind a flood.
_SCRYPT_THREADS = 2
_SCRYPT_QUEUE = 64
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"

audit = logging.getLogger("gpubroker.audit")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_token(secret: str, key: bytes | None = None) -> str:
    """The stored form of a token's secret: HMAC-SHA256 under a fresh random key (enough for 256-bit secrets)."""
    key = key or secrets.token_bytes(_KEY_BYTES)
    digest = hmac.new(key, secret.encode(), hashlib.sha256).digest()
    return f"{_HMAC}${_b64(key)}${_b64(digest)}"


@dataclass(frozen=True)
class _Stored:
    """A parsed ``token_hash``: the HMAC key and digest, or a legacy scrypt entry."""

    scheme: str
    key: bytes
    digest: bytes
    scrypt: tuple[int, int, int] = (0, 0, 0)


def _parse_stored(stored: str) -> _Stored | None:
    try:
        parts = stored.split("$")
        if parts[0] == _HMAC and len(parts) == 3:
            return _Stored(_HMAC, _unb64(parts[1]), _unb64(parts[2]))
        if parts[0] == "scrypt" and len(parts) == 6:
            return _Stored("scrypt", _unb64(parts[4]), _unb64(parts[5]), (int(parts[1]), int(parts[2]), int(parts[3])))
    except (ValueError, TypeError):
        pass
    return None


def _hmac_ok(secret: bytes, stored: _Stored) -> bool:
    return hmac.compare_digest(hmac.new(stored.key, secret, hashlib.sha256).digest(), stored.digest)


def _scrypt_ok(secret: bytes, stored: _Stored) -> bool:
    n, r, p = stored.scrypt
    try:
        got = hashlib.scrypt(secret, salt=stored.key, n=n, r=r, p=p, dklen=len(stored.digest) or 32)
    except (ValueError, MemoryError):
        return False
    return hmac.compare_digest(got, stored.digest)


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


def _split(token: str | None) -> tuple[str, bytes] | None:
    if not token:
        return None
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != _TOKEN_PREFIX:
        return None
    return parts[1], parts[2].encode()


class TokenVerifier:
    """Maps a presented token to its tenant, or raises Unauthenticated with one fixed message."""

    def __init__(self, config: BrokerConfig) -> None:
        # Checked instead of a real entry when the id is unknown: the same HMAC, so the same cost.
        self._dummy = _Stored(_HMAC, secrets.token_bytes(_KEY_BYTES), secrets.token_bytes(32))
        self._slow: asyncio.Semaphore | None = None
        self._slow_waiting = 0
        self.reload(config)

    @property
    def known_ids(self) -> set[str]:
        return set(self._by_id)

    def reload(self, config: BrokerConfig) -> None:
        self._by_id: dict[str, tuple[TenantConfig, _Stored | None]] = {
            t.token_id: (t, _parse_stored(t.token_hash)) for t in config.tenants.values()}
        # Legacy scrypt entries only: sha256(token) -> tenant name for tokens already proven (successes only).
        self._verified: dict[bytes, str] = {}

    def _entry(self, token: str | None) -> tuple[TenantConfig | None, _Stored, bytes]:
        split = _split(token)
        if split is None:
            return None, self._dummy, b""
        tenant, stored = self._by_id.get(split[0], (None, None))
        if tenant is None or stored is None:
            return None, self._dummy, split[1]
        return tenant, stored, split[1]

    def tenant_for(self, token: str | None) -> str:
        """The token's tenant. Never runs scrypt: a legacy entry must have been proven by ``prepare`` first."""
        name = self.lookup(token)
        if name is None:
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        return name

    def lookup(self, token: str | None) -> str | None:
        """``tenant_for`` without the exception: the check itself, which costs the same for any token."""
        tenant, stored, secret = self._entry(token)
        if stored.scheme == _HMAC:
            # Always one HMAC and one constant-time compare: unknown ids, wrong and right secrets cost the same.
            ok = _hmac_ok(secret, stored)
            return tenant.name if ok and tenant is not None else None
        if token and tenant is not None and self._verified.get(hashlib.sha256(token.encode()).digest()) == tenant.name:
            return tenant.name
        return None

    def needs_slow_check(self, token: str | None) -> bool:
        tenant, stored, _ = self._entry(token)
        return (tenant is not None and stored.scheme == "scrypt"
                and hashlib.sha256(str(token).encode()).digest() not in self._verified)

    async def prepare(self, token: str | None) -> None:
        """Prove a token of a legacy scrypt entry off the event loop (a few threads at once), caching a success."""
        if not self.needs_slow_check(token):
            return
        tenant, stored, secret = self._entry(token)
        assert tenant is not None and token is not None
        if self._slow is None:
            self._slow = asyncio.Semaphore(_SCRYPT_THREADS)
        if self._slow_waiting >= _SCRYPT_QUEUE:
            raise Unavailable("too many token checks in progress; retry shortly (rotate this tenant's token to "
                              "the current format to avoid the wait)")
        self._slow_waiting += 1
        try:
            async with self._slow:
                ok = await asyncio.to_thread(_scrypt_ok, secret, stored)
        finally:
            self._slow_waiting -= 1
        current = self._by_id.get(tenant.token_id)
        if ok and current is not None and current[0].token_hash == tenant.token_hash:  # not rotated meanwhile
            self._verified[hashlib.sha256(token.encode()).digest()] = tenant.name

    @staticmethod
    def token_from_metadata(metadata: object) -> str | None:
        # (key, value) pairs from any transport; grpc's stubs type them as a class that is not iterable
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                return value[len("Bearer "):].strip()
        return None


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant, proven by a token or a client certificate."""

    tenant: str
    admin: bool
    via: str  # "token" or "certificate"
    # What proved it: the stored token hash (a rotation changes it) or the certificate's identity. Channels that
    # outlive their first call (streams, links, segment connections) are closed when it stops being valid.
    credential: str = ""

    def require_admin(self, action: str) -> None:
        if not self.admin:
            # (per tenant at most 20 lines in 10 s: a non-admin calling Admin in a loop wrote 75 KiB/s of the log)
            _denials.warning(f"admin denials of tenant {self.tenant}", "denied: tenant=%s action=%s (not an admin)",
                             self.tenant, action)
            raise PermissionDenied(f"{action} needs an admin identity")


@dataclass(frozen=True)
class Credentials:
    """What a caller presents, whichever way it came (a gRPC call's metadata and auth context, a link's hello and
    TLS session): a bearer token, a verified client certificate's names (SAN URIs, then its CN), and the peer as
    audit lines name it."""

    token: str | None
    certificate_names: tuple[str, ...]
    peer: str
    certificate_issued: float | None = None  # the certificate's notBefore, Unix seconds (None: unknown or none)


def certificate_identities(auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
    """A verified client certificate's SAN URIs, then its CN (gRPC puts them in the auth context)."""
    names = [v.decode() for v in auth_context.get("x509_subject_alternative_name", ()) if b"://" in v]
    names += [v.decode() for v in auth_context.get("x509_common_name", ())]
    return names


def grpc_credentials(metadata: object, auth_context: Mapping[str, Iterable[bytes]], peer: str) -> Credentials:
    """A gRPC call's credentials: the bearer token of its metadata, the names of its auth context and when its
    certificate was issued."""
    names = tuple(certificate_identities(auth_context))
    issued = None
    if names:
        pem = next(iter(auth_context.get("x509_pem_cert", ())), None)
        issued = _pem_issued(pem) if pem is not None else None
    return Credentials(TokenVerifier.token_from_metadata(metadata), names, peer, issued)


@functools.lru_cache(maxsize=256)
def _pem_issued(pem: bytes) -> float | None:
    """A PEM certificate's notBefore (gRPC verified it; parsed once per certificate, not per call)."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(pem).not_valid_before_utc.timestamp()
    except ValueError:
        return None


def peer_certificate_issued(cert: object) -> float | None:
    """A verified client certificate's notBefore, from `ssl.SSLSocket.getpeercert`'s dict."""
    if not isinstance(cert, dict) or not isinstance(cert.get("notBefore"), str):
        return None
    try:
        return float(ssl.cert_time_to_seconds(cert["notBefore"]))
    except ValueError:
        return None


# How much earlier than its tenant's certificates_since a certificate's notBefore may be: an operator may mint a
# tenant's certificate just before adding the tenant (the docs' own example does), and certificates are backdated
# for clock skew (``gpubroker certs client``: 5 minutes). A removed tenant's certificates were issued when it was
# added, as a rule long before its name is given again.
CERTIFICATE_SKEW_SECONDS = 3600.0


def peer_certificate_names(cert: object) -> tuple[str, ...]:
    """A verified client certificate's names as `ssl.SSLSocket.getpeercert` gives them, in gRPC's order and with
    its choice (SAN URIs, then the CN): a link over TLS authenticates as a gRPC call with that certificate."""
    if not isinstance(cert, dict):
        return ()
    names = [value for kind, value in cert.get("subjectAltName", ()) if kind == "URI" and "://" in value]
    names += [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    return tuple(names)


def _issued_to(tenant: TenantConfig, issued: float | None) -> bool:
    """Whether a certificate issued at ``issued`` may name ``tenant``: not one issued more than
    CERTIFICATE_SKEW_SECONDS before the tenant was added (a removed tenant's, whose name was given to a new one)."""
    since = tenant.certificates_since
    return not since or (issued is not None and issued >= since - CERTIFICATE_SKEW_SECONDS)


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket | None) -> tuple[int, int]:
    """(pid, uid) of a Unix socket's peer, as the kernel recorded them at connect; (-1, -1) if unknown."""
    if sock is None:
        return -1, -1
    try:
        pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except (OSError, struct.error):
        return -1, -1
    return pid, uid


def peer_key(peer: str) -> str:
    """Whom a failure is charged to: a gRPC peer's address without its port (``ipv4:10.0.0.5:41234`` ->
    ``ipv4:10.0.0.5``), a local peer's ``uid:N`` (``ipv4:127.0.0.1:41234 uid=1000``, ``unix:PATH uid=1000``: a
    guesser reconnecting from another port or loopback address is the same peer)."""
    _, _, uid = peer.partition(" uid=")
    if uid.isdigit():  # a local peer (the gRPC gate names it by the uid owning its socket): any port, any address
        return f"uid:{uid}"
    kind = peer.partition(":")[0]
    if kind in ("ipv4", "ipv6"):
        with contextlib.suppress(AddressError):
            host = parse_host_port(peer, schemes=True).host
            return f"ipv6:[{host}]" if kind == "ipv6" else f"ipv4:{host}"
    return peer


class FailurePenalty:
    """Delays the replies to a peer's failed authentications, doubling with each failure, so that a guessing
    flood slows itself down rather than everyone else (the delay is an ``await``, never a blocked loop)."""

    def __init__(self, base: float = 0.002, cap: float = 1.0, forget_after: float = 30.0,
                 max_peers: int = 65536) -> None:
        self.base, self.cap, self.forget_after, self.max_peers = base, cap, forget_after, max_peers
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def fail(self, key: str) -> float:
        """Record a failure by ``key``; the seconds its reply should wait."""
        now = time.monotonic()
        count, last = self._failures.pop(key, (0, now))
        count = 1 if now - last > self.forget_after else min(count + 1, 64)
        self._failures[key] = (count, now)
        while len(self._failures) > self.max_peers:  # bounded: the longest-quiet peers are forgotten first
            self._failures.popitem(last=False)
        delay: float = min(self.cap, self.base * 2 ** (count - 1))
        return delay


# The most kinds of event a RateLimitedLog keeps; past it, those whose window has passed are dropped.
_MAX_KINDS = 1024


class RateLimitedLog:
    """At most ``burst`` lines per ``window`` seconds for each kind of event, then one line saying how many
    were left out: a flood of refusals is visible in the audit log but cannot fill the disk."""

    def __init__(self, logger: logging.Logger, burst: int = 20, window: float = 10.0) -> None:
        self.logger, self.burst, self.window = logger, burst, window
        self._state: dict[str, list[float]] = {}  # kind -> [window start, lines, suppressed]
        self._levels: dict[str, int] = {}  # kind -> the level of its lines (and of the line saying what was left out)

    def warning(self, kind: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object, extra: Mapping[str, object] | None = None) -> None:
        """Log the line unless ``kind`` is over its burst; ``extra`` as ``Logger.log`` takes it (fields of the
        record: a JSON line's own keys)."""
        now = time.monotonic()
        if kind not in self._state and len(self._state) >= _MAX_KINDS:
            self._forget(now)
        state = self._state.setdefault(kind, [now, 0, 0])
        self._levels[kind] = level
        if now - state[0] >= self.window:
            self._flush(kind)
            state[:] = [now, 0, 0]
        if state[1] < self.burst:
            state[1] += 1
            self.logger.log(level, msg, *args, extra=extra)
            return
        state[2] += 1
        if state[2] == 1:  # say how many were left out at the window's end, even if the flood stops
            with contextlib.suppress(RuntimeError):  # (no event loop: the next line after the window says it)
                asyncio.get_running_loop().call_later(max(0.0, state[0] + self.window - now), self._flush, kind)

    def _forget(self, now: float) -> None:
        """Drop the kinds whose window has passed (saying first what each left out): many kinds must not grow the
        table for good."""
        for kind in [k for k, state in self._state.items() if now - state[0] >= self.window]:
            self._flush(kind)
            del self._state[kind]
            self._levels.pop(kind, None)

    def _flush(self, kind: str) -> None:
        state = self._state.get(kind)
        if state is not None and state[2]:
            self.logger.log(self._levels.get(kind, logging.WARNING), "%s: %d more like this in the last %.0f s (not "
                            "logged)", kind, int(state[2]), time.monotonic() - state[0])
            state[2] = 0


_denials = RateLimitedLog(audit)

# What a call gets whose credential was revoked after it was authenticated (a reload rotated its token or removed
# its tenant while the call waited): the interceptors' and the workers' retirement alike.
REVOKED_CALL_MESSAGE = ("the credential this call was authenticated with was revoked (its token rotated or its "
                        "tenant removed); call again with the current token")


class Revocations:
    """Channels that outlive the call that authenticated them, and every gRPC call from its authentication to its
    end, by tenant, each closed (a call cancelled) when its credential is no longer the tenant's (a rotated token, a
    removed tenant) at a reload."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._by_tenant: dict[str, dict[int, tuple[str, Callable[[], Any]]]] = {}

    def watch(self, principal: Principal, on_revoke: Callable[[], Any]) -> int:
        watch_id = next(self._ids)
        self._by_tenant.setdefault(principal.tenant, {})[watch_id] = (principal.credential, on_revoke)
        return watch_id

    def unwatch(self, principal: Principal, watch_id: int) -> None:
        watches = self._by_tenant.get(principal.tenant)
        if watches is not None:
            watches.pop(watch_id, None)
            if not watches:
                del self._by_tenant[principal.tenant]

    def __len__(self) -> int:
        return sum(len(w) for w in self._by_tenant.values())

    def revoke_stale(self, valid: Callable[[str, str], bool]) -> dict[str, int]:
        """Call ``on_revoke`` of every channel whose (tenant, credential) is no longer ``valid``."""
        revoked: dict[str, int] = {}
        for tenant, watches in list(self._by_tenant.items()):
            for watch_id, (credential, on_revoke) in list(watches.items()):
                if valid(tenant, credential):
                    continue
                watches.pop(watch_id, None)
                revoked[tenant] = revoked.get(tenant, 0) + 1
                try:
                    on_revoke()
                except Exception:  # one channel's close must not spare the others
                    logging.getLogger("gpubroker.server").exception("closing a revoked channel failed")
            if not watches:
                self._by_tenant.pop(tenant, None)
        return revoked


AUTH_FAILURE_KINDS = ("token", "certificate")

# The delay a failed authentication in this call earned (set by Authenticator.authenticate, applied by the
# transport before it answers, so the failing peer waits and nobody else does).
failure_delay: contextvars.ContextVar[float] = contextvars.ContextVar("failure_delay", default=0.0)


async def wait_failure_delay() -> None:
    """Before answering a failed authentication: wait out the delay it earned (that peer's penalty, see
    FailurePenalty), once; nobody else waits."""
    delay = failure_delay.get()
    if delay:
        failure_delay.set(0.0)
        await asyncio.sleep(delay)


class Authenticator:
    """Turns a call's credentials into a Principal; every failure gets the same UNAUTHENTICATED message."""

    def __init__(self, config: BrokerConfig) -> None:
        self.tokens = TokenVerifier(config)
        self.penalty = FailurePenalty(cap=config.auth_failure_delay_max_seconds)
        self.revocations = Revocations()
        self.audit = RateLimitedLog(audit)
        # Failed authentications, by what failed ("token": missing, unknown or wrong; "certificate": a client
        # certificate that maps to no tenant): gpubroker_auth_failures_total.
        self.failures: dict[str, int] = dict.fromkeys(AUTH_FAILURE_KINDS, 0)
        self.reload(config)

    def reload(self, config: BrokerConfig) -> None:
        self.config = config
        self.penalty.cap = config.auth_failure_delay_max_seconds
        self.tokens.reload(config)
        for tenant, n in sorted(self.revocations.revoke_stale(self.valid).items()):
            audit.warning("action=revoke tenant=%s channels_closed=%d (token rotated or tenant removed)", tenant, n)

    def valid(self, tenant: str, credential: str) -> bool:
        """Whether a channel authenticated by ``credential`` may go on: its tenant exists and, for a token, still
        has that token."""
        t = self.config.tenants.get(tenant)
        if t is None:
            return False
        return credential.startswith(f"certificate:{t.certificates_since!r}:") or credential == t.token_hash

    async def prepare(self, metadata: object) -> None:
        """What authentication may need off the event loop (legacy scrypt entries), before ``authenticate``."""
        await self.tokens.prepare(TokenVerifier.token_from_metadata(metadata))

    def authenticate(self, credentials: Credentials, method: str = "", penalty_key: str | None = None) -> Principal:
        """The Principal ``credentials`` prove: a mapped client certificate first (on TLS), else the token."""
        tls = self.config.tls
        peer = credentials.peer
        identities = list(credentials.certificate_names) if tls is not None else []
        for identity in identities:
            name = tls.identities.get(identity, identity) if tls is not None else identity
            tenant = self.config.tenants.get(name)
            if tenant is not None and _issued_to(tenant, credentials.certificate_issued):
                # (the credential names the tenant's certificates_since: a tenant removed and added again in one
                # reload ends the channels its predecessor's certificates authenticated)
                return Principal(tenant.name, tenant.admin, "certificate",
                                 f"certificate:{tenant.certificates_since!r}:{identity}")
        if tls is not None and identities and not tls.allow_tokens:
            self.failures["certificate"] += 1
            self._failed(peer, penalty_key, "auth failure: peer=%s method=%s certificate=%s maps to no tenant",
                         peer, method, identities)
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        token = credentials.token
        try:
            name = self.tokens.tenant_for(token)
        except Unauthenticated:
            token_id = token.split("_", 2)[1] if token and token.count("_") >= 2 else "-"
            known = token_id in self.tokens.known_ids
            self.failures["token"] += 1
            self._failed(peer, penalty_key, "auth failure: peer=%s method=%s token_id=%s", peer, method,
                         token_id if known else "unknown", token_id=token_id if known else None)
            raise
        tenant = self.config.tenants[name]
        return Principal(tenant.name, tenant.admin, "token", tenant.token_hash)

    def _failed(self, peer: str, penalty_key: str | None, msg: str, *args: object, token_id: str | None = None
                ) -> None:
        named = peer_key(peer)
        # Rate-limited per known token id (a stolen token tried with wrong secrets: what an operator watches for),
        # per local user, and for remote peers together (addresses are too many to each get lines of their own):
        # one peer's flood of failures must not keep a guess at a real token out of the log.
        kind = (f"auth failures of token {token_id}" if token_id is not None
                else f"auth failures from {named}" if named.startswith("uid:") else "auth failures from remote peers")
        self.audit.warning(kind, msg, *args)
        failure_delay.set(self.penalty.fail(penalty_key or named))
