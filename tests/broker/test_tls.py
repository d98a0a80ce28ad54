"""TLS and mTLS on TCP listeners, through real broker processes; certificates minted per test run."""

from __future__ import annotations

import datetime as dt
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker import cli
from gpubroker.broker.certs import CertPaths, init_certs, mint_client_cert
from gpubroker.broker.config import BrokerConfig, TlsConfig
from gpubroker.broker.front._server import tcp_credentials
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    FailedPrecondition,
    InvalidArgument,
    RemoteGpu,
    TlsOptions,
    Unauthenticated,
    Unavailable,
    connect,
)

TENANTS = [TenantSpec("alice", memory_quota=3 << 30), TenantSpec("bob", memory_quota=1 << 30)]
BOB_URI = "spiffe://gpubroker.test/bob"
TIMEOUT = 15.0  # every client call is bounded: a refused handshake must fail, never hang


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertPaths]:
    good, other = tmp_path_factory.mktemp("ca"), tmp_path_factory.mktemp("other-ca")
    ca, server = init_certs(good)
    init_certs(other)
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    return {
        "ca": ca, "server": server, "other_ca": CertPaths(other / "ca.pem", other / "ca.key"),
        "alice": mint_client_cert(good, "alice"),  # CN names the tenant itself
        "svc": mint_client_cert(good, "svc", uri=BOB_URI),  # SAN URI mapped to bob in [tls.identities]
        "stranger": mint_client_cert(good, "stranger"),  # valid, but names no tenant
        "expired": mint_client_cert(good, "alice-old", not_before=past, not_after=past + dt.timedelta(days=1)),
        "foreign": mint_client_cert(other, "alice"),  # the right CN from the wrong CA
    }


def _tls_config(certs: dict[str, CertPaths], **overrides: object) -> TlsConfig:
    fields: dict[str, object] = {
        "cert_file": str(certs["server"].cert), "key_file": str(certs["server"].key),
        "client_ca_file": str(certs["ca"].cert), "require_client_cert": True, "identities": {BOB_URI: "bob"}}
    return TlsConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def _client(certs: dict[str, CertPaths], who: str | None, ca: str = "ca") -> TlsOptions:
    cert = certs[who] if who else None
    return TlsOptions(ca_file=certs[ca].cert, cert_file=cert.cert if cert else None,
                      key_file=cert.key if cert else None)


@pytest.fixture(scope="module")
def tls_broker(backend: str, certs: dict[str, CertPaths]) -> Iterator[BrokerProcess]:
    with BrokerProcess(TENANTS, backend=backend, tcp=["127.0.0.1:0"],
                       settings={"tls": _tls_config(certs)}) as proc:
        yield proc


def _round_trip(gpu: RemoteGpu) -> None:
    data = np.arange(4096, dtype=np.float32)
    buf = gpu.allocate_memory(data.nbytes)
    gpu.copy_h2d(data, buf)
    out = np.empty_like(data)
    gpu.copy_d2h(buf, out)
    np.testing.assert_array_equal(out, data)
    gpu.free_memory(buf)


def _refused(target: str, tls: TlsOptions, token: str | None = None) -> Exception:
    start = time.monotonic()
    with pytest.raises((Unavailable, Unauthenticated)) as info:
        connect(target, token, tls=tls, timeout=TIMEOUT).close()
    assert time.monotonic() - start < TIMEOUT
    return info.value


def test_client_certificate_authenticates_its_tenant_without_a_token(tls_broker: BrokerProcess,
                                                                     certs: dict[str, CertPaths]) -> None:
    with connect(tls_broker.tcp_target, tls=_client(certs, "alice"), timeout=TIMEOUT) as gpu:
        assert gpu.device_info().memory_quota == 3 << 30
        _round_trip(gpu)


def test_san_uri_mapped_in_identities_names_the_tenant(tls_broker: BrokerProcess,
                                                       certs: dict[str, CertPaths]) -> None:
    with connect(tls_broker.tcp_target, tls=_client(certs, "svc"), timeout=TIMEOUT) as gpu:
        assert gpu.device_info().memory_quota == 1 << 30


def test_unmapped_certificate_needs_a_token(tls_broker: BrokerProcess, certs: dict[str, CertPaths]) -> None:
    assert isinstance(_refused(tls_broker.tcp_target, _client(certs, "stranger")), Unauthenticated)
    # allow_tokens defaults to true: the certificate gets the client through TLS, the token names bob.
    with connect(tls_broker.tcp_target, tls_broker.tokens["bob"], tls=_client(certs, "stranger"),
                 timeout=TIMEOUT) as gpu:
        assert gpu.device_info().memory_quota == 1 << 30


@pytest.mark.parametrize(("who", "reason"), [
    ("foreign", "unable to get local issuer certificate"),
    ("expired", "certificate has expired"),
    (None, "PEER_DID_NOT_RETURN_A_CERTIFICATE"),
], ids=["other-ca", "expired", "no-cert"])
def test_handshake_refuses_bad_or_missing_client_certificates(tls_broker: BrokerProcess, certs: dict[str, CertPaths],
                                                              who: str | None, reason: str) -> None:
    # A valid token does not help: the TLS handshake itself fails before any call is authenticated.
    err = _refused(tls_broker.tcp_target, _client(certs, who), tls_broker.tokens["alice"])
    assert isinstance(err, Unavailable)
    # gRPC's own words ("Socket closed", or a reset, as the handshake's timing goes) get what to check in front.
    assert err.message.startswith("the broker closed the connection") and "require a client certificate" in \
        err.message, err.message
    # The broker's gRPC core logs why it refused, which tells these cases apart (the client sees only a reset);
    # it logs that at INFO, which GRPC_VERBOSITY=ERROR silences.
    if os.environ.get("GRPC_VERBOSITY", "").upper() in ("ERROR", "NONE"):
        return
    deadline = time.monotonic() + 5.0
    while reason not in tls_broker.log_tail(100_000) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reason in tls_broker.log_tail(100_000)


def test_client_refuses_a_broker_its_ca_did_not_sign(tls_broker: BrokerProcess, certs: dict[str, CertPaths]) -> None:
    assert isinstance(_refused(tls_broker.tcp_target, _client(certs, "alice", ca="other_ca")), Unavailable)


def test_unix_socket_keeps_token_auth_beside_tls(tls_broker: BrokerProcess) -> None:
    with connect(tls_broker.target, tls_broker.tokens["alice"], timeout=TIMEOUT) as gpu:
        _round_trip(gpu)


def test_allow_tokens_false_accepts_only_certificates(backend: str, certs: dict[str, CertPaths]) -> None:
    with BrokerProcess(TENANTS, backend=backend, tcp=["127.0.0.1:0"],
                       settings={"tls": _tls_config(certs, allow_tokens=False)}) as proc:
        err = _refused(proc.tcp_target, _client(certs, "stranger"), proc.tokens["bob"])
        assert isinstance(err, Unauthenticated)
        with connect(proc.tcp_target, proc.tokens["bob"], tls=_client(certs, "alice"), timeout=TIMEOUT) as gpu:
            assert gpu.device_info().memory_quota == 3 << 30  # the certificate decides, not the token
        with connect(proc.target, proc.tokens["bob"], timeout=TIMEOUT) as gpu:  # the local socket keeps tokens
            assert gpu.device_info().memory_quota == 1 << 30


def test_non_loopback_plaintext_refuses_to_start(backend: str) -> None:
    proc = BrokerProcess(TENANTS, backend=backend, tcp=["0.0.0.0:0"])
    with pytest.raises(Unavailable, match=r"refusing plaintext TCP on non-loopback 0\.0\.0\.0:0"):
        proc.start()
    assert proc.process is not None and proc.process.returncode == 2
    proc.stop()


def test_insecure_plaintext_warns_and_carries_the_token_as_metadata(backend: str) -> None:
    with BrokerProcess(TENANTS, backend=backend, tcp=["0.0.0.0:0"], settings={"insecure": True}) as proc:
        assert "WARNING" in proc.log_tail() and "tokens travel in the clear" in proc.log_tail()
        target = "127.0.0.1:" + proc.tcp_target.rsplit(":", 1)[1]
        with connect(target, proc.tokens["alice"], tls=TlsOptions(insecure=True), timeout=TIMEOUT) as gpu:
            _round_trip(gpu)
        assert isinstance(_refused(target, TlsOptions(insecure=True)), Unauthenticated)


def test_client_tls_options_need_a_key_with_a_cert(certs: dict[str, CertPaths]) -> None:
    with pytest.raises(InvalidArgument, match="both cert and key"):
        connect("127.0.0.1:1", tls=TlsOptions(cert_file=certs["alice"].cert))


def test_tls_misconfiguration_is_refused(certs: dict[str, CertPaths], tmp_path: Path) -> None:
    cases = [
        (_tls_config(certs, client_ca_file=""), "needs client_ca_file"),
        (_tls_config(certs, require_client_cert=False, allow_tokens=False), "needs require_client_cert"),
        (_tls_config(certs, cert_file=str(tmp_path / "missing.pem")), "missing.pem"),
    ]
    for tls, message in cases:
        with pytest.raises(FailedPrecondition, match=message):
            tcp_credentials(BrokerConfig(tls=tls), "127.0.0.1:0")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", *args], capture_output=True, text=True)


def test_certs_commands_write_private_keys_and_print_the_config(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    init = _cli("certs", "init", "--dir", str(d), "--san", "gpu.example.org", "--san", "10.1.2.3")
    assert init.returncode == 0, init.stderr
    assert "[tls]" in init.stdout and str(d / "server.pem") in init.stdout and "gpu.example.org" in init.stdout
    client = _cli("certs", "client", "team-a", "--dir", str(d), "--uri", "spiffe://x/team-a", "--days", "30")
    assert client.returncode == 0, client.stderr
    assert '"spiffe://x/team-a" = "team-a"' in client.stdout
    for key in (d / "ca.key", d / "server.key", d / "clients" / "team-a.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert (d / "clients" / "team-a.pem").exists()
    ca = (d / "ca.pem").read_bytes()
    again = _cli("certs", "init", "--dir", str(d))
    assert again.returncode == 2 and "--force" in again.stderr and (d / "ca.pem").read_bytes() == ca
    assert _cli("certs", "init", "--dir", str(d), "--force").returncode == 0
    assert (d / "ca.pem").read_bytes() != ca


def test_serve_insecure_flag_sets_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[BrokerConfig] = []
    monkeypatch.setattr("gpubroker.broker.front.run_broker", lambda cfg, ready_file=None: seen.append(cfg))
    (tmp_path / "c.toml").write_text("")  # (an empty config: no tenants)
    assert cli.main(["serve", "--config", str(tmp_path / "c.toml"), "--insecure"]) == 0
    assert seen[0].insecure is True
