"""A client certificate outlives the tenant it was issued to: a tenant added again under the name got it.

The hole (issue 21, lifecycle, a fresh attack): with mTLS a certificate names its tenant by its CN (or a
``[tls.identities]`` entry), checked at each call against the tenants the broker has now. ``tenant remove`` and a
reload refuse it, as they should; but the certificate itself cannot be revoked (the broker takes no CRL, and a
certificate's term is a year by default), so once a tenant was added again under the same name (a new team, a new
customer given a freed name, with a new token and a new quota) every certificate ever issued to the removed one
authenticated as the new one: its sessions, its quota, its data. Measured before the fix: the removed alice's
certificate opened a session of the new alice (quota 3 GiB, not the removed one's 1 GiB) right after the reload
that added her.

The fix: ``tenant add`` writes the tenant's ``certificates_since``; a certificate issued more than an hour before it
(its notBefore) authenticates nobody as that tenant, and a certificate minted for the new tenant works.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gpubroker.broker.certs import CertPaths, init_certs, mint_client_cert
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, TlsOptions, connect

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertPaths]:
    d = tmp_path_factory.mktemp("ca")
    ca, server = init_certs(d)
    # The removed alice's certificate was issued when she was added, as a rule long before her name is freed.
    issued = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    return {"ca": ca, "server": server, "alice": mint_client_cert(d, "alice", not_before=issued)}


@pytest.fixture(scope="module")
def broker(certs: dict[str, CertPaths]) -> Iterator[BrokerProcess]:
    tls = TlsConfig(cert_file=str(certs["server"].cert), key_file=str(certs["server"].key),
                    client_ca_file=str(certs["ca"].cert), require_client_cert=True)
    tenants = [TenantSpec("alice", memory_quota=1 << 30), TenantSpec("ops", admin=True)]
    with BrokerProcess(tenants, backend="opencl", tcp=["127.0.0.1:0"], settings={"tls": tls}) as proc:
        yield proc


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", *args], capture_output=True, text=True, check=True)


def _reload(broker: BrokerProcess) -> None:
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        admin.reload()


def _quota_with_the_old_certificate(broker: BrokerProcess, certs: dict[str, CertPaths],
                                    client: str = "alice") -> int | None:
    """The memory quota of the tenant the removed alice's certificate authenticates as (None: refused)."""
    tls = TlsOptions(ca_file=certs["ca"].cert, cert_file=certs[client].cert, key_file=certs[client].key)
    try:
        with connect(broker.tcp_target, tls=tls, timeout=TIMEOUT) as gpu:
            return gpu.device_info().memory_quota
    except Exception:
        return None


def test_a_removed_tenants_certificate_does_not_authenticate_a_tenant_added_again_under_its_name(
        broker: BrokerProcess, certs: dict[str, CertPaths]) -> None:
    assert _quota_with_the_old_certificate(broker, certs) == 1 << 30  # (alice's own, while she exists)
    _cli("tenant", "remove", "alice", "--config", str(broker.config_path))
    _reload(broker)
    assert _quota_with_the_old_certificate(broker, certs) is None, "a removed tenant's certificate still served"
    # A new tenant given the freed name: a new token, a new quota.
    _cli("tenant", "add", "alice", "--config", str(broker.config_path), "--memory", "3GiB")
    _reload(broker)
    quota = _quota_with_the_old_certificate(broker, certs)
    assert quota is None, (f"the removed alice's certificate authenticated as the new alice (quota {quota >> 30} "
                           "GiB): a re-added tenant inherits every certificate issued to the name")
    # The new alice's own certificate, minted after she was added, is hers.
    certs["new alice"] = mint_client_cert(certs["ca"].cert.parent, "alice", force=True)
    assert _quota_with_the_old_certificate(broker, certs, "new alice") == 3 << 30
