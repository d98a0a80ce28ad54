"""Load-test settings and their checks: the mix of workloads, the target (local, or remote over TLS) and the tokens
file."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from gpubroker.client import InvalidArgument, TlsOptions
from gpubroker.loadtest._workloads import WORKLOADS
from gpubroker.wire.addresses import AddressError, parse_host_port, unix_path

__all__ = ["MAX_DURATION_S", "MAX_TENANTS", "LoadTestConfig", "assign_workloads", "check_target", "load_tokens"]

MAX_TENANTS = 64
MAX_DURATION_S = 3600.0


@dataclass
class LoadTestConfig:
    tenants: int = 4
    duration: float = 10.0
    mix: str = ",".join(WORKLOADS)
    backend: str = "auto"  # the embedded broker's; ignored with a target
    target: str | None = None  # a running broker (unix:/path or a loopback host:port) instead of an embedded one
    tls_ca: str | None = None  # TLS to a host:port target: the CA of the broker's certificate (a remote one needs it)
    tls_cert: str | None = None  # with tls_key: a client certificate, for a broker that requires one (mTLS)
    tls_key: str | None = None
    tokens_file: str | None = None  # with target: JSON {tenant: token}, including the admin tenant's
    admin_tenant: str = "admin"
    device: int = 0
    max_ops: int = 1_000_000  # per tenant
    long_ms: float = 5.0
    copy_bytes: int = 4 << 20
    out: str = "loadtest.json"
    png: str | None = None  # default: beside ``out``, with .png
    sample_interval: float = 0.5  # how often the parent samples usage and redraws progress
    setup_timeout: float = 120.0  # for tenants to connect and compile

    def check(self) -> None:
        if not 1 <= self.tenants <= MAX_TENANTS:
            raise InvalidArgument(f"--tenants must be 1 to {MAX_TENANTS}, not {self.tenants}")
        if not 0 < self.duration <= MAX_DURATION_S:
            raise InvalidArgument(f"--duration must be more than 0 and at most {MAX_DURATION_S:g} s, "
                                  f"not {self.duration:g}")
        if self.max_ops < 1:
            raise InvalidArgument(f"--max-ops must be at least 1, not {self.max_ops}")
        if not 0 < self.long_ms <= 1000:
            raise InvalidArgument(f"--long-ms must be more than 0 and at most 1000, not {self.long_ms:g}")
        if not 16 <= self.copy_bytes <= 1 << 30:
            raise InvalidArgument(f"--copy-bytes must be 16 B to 1 GiB, not {self.copy_bytes}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("--tls-cert and --tls-key go together (a client certificate and its key)")
        if self.tls is not None and (self.target is None or unix_path(self.target) is not None):
            raise InvalidArgument("--tls-ca, --tls-cert and --tls-key are for a host:port --target")
        if self.target is not None:
            check_target(self.target, remote=self.tls_ca is not None)
            if not self.tokens_file:
                raise InvalidArgument("--target needs --tokens FILE (JSON: tenant name -> token)")
        assign_workloads(self.mix, self.tenants)

    @property
    def tls(self) -> TlsOptions | None:
        """The TLS options for a host:port target, if any were given."""
        if self.tls_ca is None and self.tls_cert is None:
            return None
        return TlsOptions(ca_file=self.tls_ca, cert_file=self.tls_cert, key_file=self.tls_key)

    @property
    def png_path(self) -> str:
        return self.png or str(Path(self.out).with_suffix(".png"))


def assign_workloads(mix: str, tenants: int) -> list[str]:
    """One workload per tenant: ``a,b,c`` round-robin, ``a=3,b=1`` in proportion, interleaved.

    Smooth weighted round-robin: each pick adds every weight to its credit and takes the largest credit,
    so equal weights give plain round-robin and any prefix of the order is as close to the weights as it can be.
    """
    weights: dict[str, int] = {}
    for item in (part.strip() for part in mix.split(",")):
        if not item:
            continue
        name, _, weight = item.partition("=")
        name = name.strip()
        if name not in WORKLOADS:
            raise InvalidArgument(f"unknown workload {name!r} in --mix; expected some of {', '.join(WORKLOADS)}")
        if name in weights:
            raise InvalidArgument(f"workload {name!r} appears twice in --mix")
        try:
            weights[name] = int(weight) if weight else 1
        except ValueError:
            raise InvalidArgument(f"weight {weight!r} of {name!r} in --mix is not an integer") from None
        if weights[name] < 0:
            raise InvalidArgument(f"weight of {name!r} in --mix is negative")
    weights = {k: w for k, w in weights.items() if w > 0}
    if not weights:
        raise InvalidArgument(f"--mix names no workload with a positive weight: {mix!r}")
    total = sum(weights.values())
    credit = dict.fromkeys(weights, 0)
    order = []
    for _ in range(tenants):
        for name, share in weights.items():
            credit[name] += share
        pick = max(credit, key=lambda k: credit[k])  # ties: the first in --mix order
        credit[pick] -= total
        order.append(pick)
    return order


def check_target(target: str, remote: bool = False) -> str:
    """``target`` if it is a Unix socket or a loopback TCP address, or with ``remote`` (TLS given, so the tokens
    travel encrypted, to the broker the CA vouches for) any ``host:port``."""
    hint = ("loadtest targets must be a Unix socket (unix:/path) or a loopback address "
            f"(127.0.0.1:PORT, [::1]:PORT, localhost:PORT), or a remote HOST:PORT with --tls-ca, not {target!r}")
    path = unix_path(target)
    if path is not None:
        if not path.lstrip("/"):
            raise InvalidArgument(hint)
        return target
    try:
        address = parse_host_port(target)
    except AddressError:
        raise InvalidArgument(hint) from None
    host = address.host
    if address.port == 0:
        raise InvalidArgument(hint)
    if host == "localhost" or (remote and host not in ("0.0.0.0", "::")):
        return target
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidArgument(hint)
    return target


def load_tokens(path: str, admin_tenant: str, tenants: int) -> tuple[dict[str, str], str | None]:
    """The first ``tenants`` tenants' tokens from a JSON object {tenant: token}, and the admin tenant's (if any)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read tokens file {path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise InvalidArgument(f"tokens file {path} must be a JSON object of tenant name -> token string")
    admin = data.pop(admin_tenant, None)
    if len(data) < tenants:
        raise InvalidArgument(f"tokens file {path} has {len(data)} tenants besides {admin_tenant!r}; "
                              f"--tenants asks for {tenants}")
    return dict(list(data.items())[:tenants]), admin
