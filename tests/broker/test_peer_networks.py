"""How the front groups remote TCP peers into one peer for every per-peer cap and rate (`PeerNetworks`,
``peer_network_ipv4`` / ``peer_network_ipv6``): by default a /24 or /64; an operator whose clients each hold an
address of one network (pods of a Kubernetes node) gives each its own caps with 32 / 128. Local peers stay counted
by their uid and guests by their CID, whatever the grouping."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpubroker.broker.config import load_config
from gpubroker.broker.front.listeners import DEFAULT_NETWORKS, Peer, PeerNetworks
from gpubroker.client import InvalidArgument
from gpubroker.wire.addresses import TcpAddress, VsockAddress


def remote(host: str, networks: PeerNetworks = DEFAULT_NETWORKS) -> Peer:
    return Peer(-1, -1, TcpAddress(host, 40000), (host, 40000), networks=networks)


def test_by_default_a_remote_peer_is_its_24_or_64() -> None:
    assert remote("10.1.2.3").key == remote("10.1.2.200").key == "10.1.2.0/24"
    assert remote("10.1.3.3").key != remote("10.1.2.3").key
    assert remote("2001:db8:0:1::5").key == remote("2001:db8:0:1:ffff::9").key == "2001:db8:0:1::/64"


def test_a_longer_prefix_gives_each_address_its_own_caps() -> None:
    each = PeerNetworks(ipv4=32, ipv6=128)
    assert remote("10.1.2.3", each).key == "10.1.2.3/32"
    assert remote("10.1.2.3", each).key != remote("10.1.2.4", each).key
    assert remote("2001:db8::5", each).key != remote("2001:db8::6", each).key


def test_local_peers_and_guests_are_counted_by_uid_and_cid_whatever_the_grouping() -> None:
    each = PeerNetworks(ipv4=32, ipv6=128)
    assert Peer(-1, 1000, TcpAddress("127.0.0.2", 5), ("127.0.0.2", 5), local=True, networks=each).key == "uid 1000"
    assert Peer(-1, -1, VsockAddress(7, 5), (7, 5), networks=each).key == "vsock 7"


@pytest.mark.parametrize(("key", "value"), [("peer_network_ipv4", 33), ("peer_network_ipv4", 4),
                                            ("peer_network_ipv6", 129), ("peer_network_ipv6", 16)])
def test_a_prefix_outside_its_family_is_refused_by_its_key(tmp_path: Path, key: str, value: int) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(f"[broker]\n{key} = {value}\n")
    with pytest.raises(InvalidArgument, match=key):
        load_config(path)


def test_the_keys_load(tmp_path: Path) -> None:
    path = tmp_path / "broker.toml"
    path.write_text("[broker]\npeer_network_ipv4 = 32\npeer_network_ipv6 = 128\n")
    config = load_config(path)
    assert (config.peer_network_ipv4, config.peer_network_ipv6) == (32, 128)
