"""Config round trips, token minting and verification, and `gpubroker tenant add`."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpubroker.broker.auth import TokenVerifier, hash_token, mint_token
from gpubroker.broker.config import (
    BrokerConfig,
    TenantConfig,
    load_config,
    parse_size,
    save_config,
)
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
