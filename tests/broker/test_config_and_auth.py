"""Config round trips, token minting and verification, and `gpubroker tenant add`."""

from __future__ import annotations

import re
import stat
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import msgspec
import pytest

from gpubroker.broker.config import (
    BrokerConfig,
    BrokerSettings,
    TenantConfig,
    TlsConfig,
    load_config,
    parse_config,
    parse_size,
    parse_uid_range,
    save_config,
)
from gpubroker.broker.front.auth import TokenVerifier, hash_token, mint_token, peer_key
from gpubroker.client import AlreadyExists, InvalidArgument, Unauthenticated


def test_parse_size() -> None:
    assert parse_size("8GiB") == 8 * 1024**3
    assert parse_size("512 MiB") == 512 * 1024**2
    assert parse_size("1.5k") == 1500
    assert parse_size(42) == 42
    with pytest.raises(InvalidArgument):
        parse_size("lots")


def test_config_round_trip_keeps_tenants_and_limits(tmp_path: Path) -> None:
    cfg = BrokerConfig(listen=["unix:/tmp/x.sock", "127.0.0.1:0"], backend="opencl", lease_seconds=5.0)
    token = mint_token()
    cfg.add_tenant(TenantConfig("team-a", token.token_id, token.token_hash, 3 * 1024**3, 2))
    path = save_config(cfg, tmp_path / "c.toml")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_config(path)
    assert again.listen == cfg.listen and again.backend == "opencl" and again.lease_seconds == 5.0
    assert again.tenants["team-a"] == cfg.tenants["team-a"]
    assert token.token not in path.read_text()
    with pytest.raises(AlreadyExists):
        again.add_tenant(TenantConfig("team-a", "x", "y"))
    with pytest.raises(InvalidArgument):
        again.add_tenant(TenantConfig("bad name!", "x", "y"))


def test_invalid_config_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[broker]\nbackend = 'vulkan'\n")
    with pytest.raises(InvalidArgument, match="backend"):
        load_config(path)
    path.write_text("[broker\n")
    with pytest.raises(InvalidArgument):
        load_config(path)


EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "gpubroker.example.toml"
# The containment keys (issue 12): the example documents each one, commented, at its default.
NEW_KEYS = ["sandbox", "cache_dir", "worker_memory_max", "worker_pids_max", "worker_cpu_weight", "max_kernel_seconds",
            "lone_kernel_seconds", "tenant_crash_budget", "tenant_crash_window_seconds", "hello_max_bytes",
            "hello_timeout_seconds", "max_unauthenticated_connections", "max_unauthenticated_per_uid",
            "peer_network_ipv4", "peer_network_ipv6", "connection_idle_seconds", "max_shared_bytes_per_tenant",
            "auth_failure_delay_max_seconds",
            # (issue 21: the gRPC front, .shm, the worker's tmpfs)
            "max_grpc_connections", "max_grpc_connections_per_peer", "grpc_idle_seconds",
            "max_grpc_streams_per_connection", "max_read_ahead_bytes_per_tenant", "max_shm_connections_per_tenant",
            "cache_max_bytes", "worker_tmp_max_bytes", "worker_uids",
            "request_message_timeout_seconds",  # (issue 21: a staged call's deadline)
            # (issue 21: how fast a peer may connect and start calls)
            "max_connections_per_peer_per_second", "connection_burst_per_peer", "max_grpc_calls_per_peer_per_second",
            "grpc_call_burst_per_peer",
            "max_unsent_reply_bytes_per_tenant",  # (issue 21: replies a client does not read)
            "max_kernel_slowdown",  # (issue 21: how far others' load may stretch a PoCL hold's limit and charge)
            "grpc_unauthenticated_seconds",  # (issue 21: peers that never authenticate hold no gRPC slot)
            # (issue 21: HTTP/2 frames that start no call)
            "max_grpc_control_frames_per_peer_per_second", "grpc_control_frame_burst_per_peer",
            "max_grpc_connections_per_tenant"]  # (issue 21: one tenant's authenticated connections)
# Values other than the defaults for keys whose type alone does not give one.
SPECIAL = {"listen": ["unix:/tmp/a.sock", "127.0.0.1:0", "[::1]:7070"], "devices": [1, 0], "chunk_bytes": 3 << 20,
           "max_message_bytes": 5 << 20, "socket_mode": 0o640, "backend": "opencl", "peer_copies": "host",
           "log_format": "json", "metrics_listen": "[::1]:9464", "worker_cpu_weight": 250,
           "device_failure_window_seconds": 7.5, "max_shared_bytes_per_tenant": 12345, "link_listen": "[::1]:7071",
           "worker_uids": "100000-100099"}


def _other_value(name: str, default: object, tp: object) -> object:
    if name in SPECIAL:
        return SPECIAL[name]
    base = typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp
    if base is bool:
        return not default
    if base is int:
        return int(default) + 7  # type: ignore[call-overload]
    if base is float:
        return float(default) + 1.25  # type: ignore[arg-type]
    if base is str:
        return f"some-{name}"
    raise AssertionError(f"no test value for [broker] {name}: add one to SPECIAL")


def test_every_broker_key_round_trips_through_save_and_load(tmp_path: Path) -> None:
    fields = msgspec.structs.fields(BrokerSettings)
    hints = typing.get_type_hints(BrokerSettings, include_extras=True)
    cfg = BrokerConfig(tls=TlsConfig(cert_file="s.pem", key_file="s.key", client_ca_file="ca.pem",
                                     require_client_cert=True, allow_tokens=False,
                                     identities={"spiffe://example.org/a": "team-a", "CN with spaces": "b"}))
    for f in fields:
        default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        value = _other_value(f.name, default, hints[f.name])
        assert value != default, f.name
        setattr(cfg, f.name, value)  # as the launcher does
    cfg.add_tenant(TenantConfig("team-a", "id-a", "hash-a", 3 << 30, 2, True, {0: 1 << 30, 3: 12345}))
    cfg.add_tenant(TenantConfig("b", "id-b", "hash-b"))
    path = save_config(cfg, tmp_path / "c.toml")
    again = load_config(path)
    for f in fields:
        assert getattr(again, f.name) == getattr(cfg, f.name), f.name
    assert again.tls == cfg.tls and again.tenants == cfg.tenants and again == cfg


def test_save_config_refuses_a_setting_of_the_wrong_type_by_its_key(tmp_path: Path) -> None:
    cfg = BrokerConfig()
    cfg.insecure = "false"  # type: ignore[assignment]
    with pytest.raises(InvalidArgument, match=r"\[broker\] insecure: expected bool"):
        save_config(cfg, tmp_path / "c.toml")
    assert not (tmp_path / "c.toml").exists()
    with pytest.raises(AttributeError):
        cfg.max_kernel_second = 3.0  # type: ignore[attr-defined]  # a typo is no new setting


def test_every_key_has_a_description() -> None:
    for struct in (BrokerSettings, TlsConfig, TenantConfig):
        schema = msgspec.json.schema(struct)["$defs"][struct.__name__]
        for key, prop in schema["properties"].items():
            assert len(prop.get("description", "")) > 20, f"{struct.__name__}.{key}"


def test_the_example_config_loads_and_documents_the_new_keys() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.socket_group == "gpubroker-clients" and cfg.socket_mode == 0o660
    text = EXAMPLE.read_text()
    defaults = BrokerSettings()
    for key in NEW_KEYS:
        match = re.search(rf"^# {key} = (.+?)\s+# \S.*$", text, re.MULTILINE)
        assert match, f"{key} is not documented (commented, with a description) in {EXAMPLE.name}"
        uncommented = parse_config(tomllib.loads(f"[broker]\n{key} = {match.group(1)}\n"))
        assert getattr(uncommented, key) == getattr(defaults, key), key


def test_tokens_verify_only_against_their_own_hash() -> None:
    cfg = BrokerConfig()
    a, b = mint_token(), mint_token()
    cfg.add_tenant(TenantConfig("a", a.token_id, a.token_hash))
    cfg.add_tenant(TenantConfig("b", b.token_id, b.token_hash))
    verifier = TokenVerifier(cfg)
    assert verifier.tenant_for(a.token) == "a"
    assert verifier.tenant_for(b.token) == "b"
    assert verifier.tenant_for(a.token) == "a"  # cached path
    swapped = f"gpb_{a.token_id}_{b.token.split('_', 2)[2]}"
    for bad in (None, "", "Bearer", swapped, "gpb_" + a.token_id, a.token + "x"):
        with pytest.raises(Unauthenticated) as info:
            verifier.tenant_for(bad)
        assert info.value.message == "missing or invalid bearer token"


def test_hash_is_salted() -> None:
    assert hash_token("same") != hash_token("same")


def test_tenant_add_prints_the_token_last_and_stores_only_a_hash(tmp_path: Path) -> None:
    config = tmp_path / "gpubroker.toml"
    proc = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "tenant", "add", "team-x", "--config",
                           str(config), "--memory", "2GiB", "--weight", "3"],
                          capture_output=True, text=True, check=True)
    token = proc.stdout.strip().splitlines()[-1]
    assert token.startswith("gpb_")
    text = config.read_text()
    assert token not in text and token.split("_", 2)[2] not in text
    cfg = load_config(config)
    assert cfg.tenants["team-x"].memory_quota == 2 * 1024**3 and cfg.tenants["team-x"].weight == 3
    assert TokenVerifier(cfg).tenant_for(token) == "team-x"
    assert cfg.tenants["team-x"].token_hash.startswith("hmac-sha256$")  # the keyed hash, not scrypt
    again = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "tenant", "add", "team-x", "--config",
                            str(config)], capture_output=True, text=True)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_devices_command_lists_a_real_device() -> None:
    proc = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "devices", "--backend", "opencl"],
                          capture_output=True, text=True, check=True)
    assert "backend: opencl" in proc.stdout
    assert "  0: " in proc.stdout


def test_worker_uids_is_a_range_and_the_old_worker_uid_names_its_replacement() -> None:
    assert parse_uid_range(parse_config({"broker": {"worker_uids": "0x7FFF0000-0x7FFFFFFE"}}).worker_uids) == (
        0x7FFF0000, 0x7FFFFFFE)
    assert parse_uid_range(BrokerSettings().worker_uids) == (0x7FFF0000, 0x7FFFFFFE)
    assert parse_uid_range(parse_config({"broker": {"worker_uids": "0"}}).worker_uids) is None  # (as root)
    for bad in ("70000", "10-5", "0-3", "a-b", "1-4294967295", ""):
        with pytest.raises(InvalidArgument, match=r"\[broker\] worker_uids: expected"):
            parse_config({"broker": {"worker_uids": bad}})
    # One uid shared by every worker was the hole: the key is refused, saying what replaced it.
    with pytest.raises(InvalidArgument, match=r"\[broker\] worker_uid: replaced by worker_uids"):
        parse_config({"broker": {"worker_uid": 65534}})


def test_a_failed_authentication_is_charged_to_a_local_peer_by_its_uid() -> None:
    """The gRPC gate names a local peer ``ADDRESS:PORT uid=N``: reconnecting from another port or loopback address
    must not give a guesser a fresh failure delay (the key kept the port, each connection a new peer)."""
    keys = {peer_key(p) for p in ("ipv4:127.0.0.1:41234 uid=1000", "ipv4:127.0.0.2:41235 uid=1000",
                                  "ipv6:[::1]:5555 uid=1000", "unix:/run/gpubroker.sock uid=1000")}
    assert keys == {"uid:1000"}
    assert peer_key("ipv4:10.0.0.5:41234") == peer_key("ipv4:10.0.0.5:9") == "ipv4:10.0.0.5"
    assert peer_key("ipv4:127.0.0.1:41234 uid=1001") != peer_key("ipv4:127.0.0.1:41234 uid=1000")
