"""Placement's choice among devices, and per-device quotas in the config and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpubroker.broker.cli import main as cli_main
from gpubroker.broker.config import TenantConfig, load_config, save_config
from gpubroker.broker.front._placement import DeviceLoad, NoServingDevice, choose_device
from gpubroker.client import InvalidArgument, ResourceExhausted


def _load(device: int, sessions: int = 0, mine: int = 0, room: int = 1, memory: float = 0.0,
          problem: str | None = None) -> DeviceLoad:
    return DeviceLoad(device=device, problem=problem, sessions=sessions, tenant_sessions=mine, room=room,
                      memory_fraction=memory)


def test_fewest_sessions_win_then_the_tenants_own_then_memory_then_the_index() -> None:
    assert choose_device("t", [_load(0, sessions=3), _load(1, sessions=2)]) == 1
    assert choose_device("t", [_load(0, sessions=2, mine=2), _load(1, sessions=2, mine=0)]) == 1
    assert choose_device("t", [_load(0, sessions=2, memory=0.5), _load(1, sessions=2, memory=0.25)]) == 1
    assert choose_device("t", [_load(0, sessions=1), _load(1, sessions=1)]) == 0


def test_a_device_that_does_not_serve_or_has_no_room_is_passed_over() -> None:
    loads = [_load(0, problem="3 worker failures"), _load(1, sessions=9, room=0), _load(2, sessions=9)]
    assert choose_device("t", loads) == 2
    with pytest.raises(ResourceExhausted, match="every serving device") as full:
        choose_device("t", loads[:2])
    assert full.value.details["devices"] == [1]
    with pytest.raises(NoServingDevice):
        choose_device("t", loads[:1])


def test_device_memory_round_trips_through_the_config(tmp_path: Path) -> None:
    cfg = load_config(tmp_path / "c.toml")
    cfg.add_tenant(TenantConfig("a", "id", "hash", memory_quota=1 << 30, device_memory={1: 16 << 30}))
    loaded = load_config(save_config(cfg))
    tenant = loaded.tenants["a"]
    assert tenant.device_memory == {1: 16 << 30}
    assert (tenant.quota_on(0), tenant.quota_on(1)) == (1 << 30, 16 << 30)
    bad = tmp_path / "bad.toml"
    bad.write_text('[tenants.a]\ntoken_id = "i"\ntoken_hash = "h"\ndevice_memory = { x = "1GiB" }\n')
    with pytest.raises(InvalidArgument, match="device_memory"):
        load_config(bad)
    bad.write_text('[broker]\ndevices = [1, 1]\n')
    with pytest.raises(InvalidArgument, match="distinct"):
        load_config(bad)
    bad.write_text('[broker]\npeer_copies = "sometimes"\n')
    with pytest.raises(InvalidArgument, match="peer_copies"):
        load_config(bad)


def test_tenant_add_takes_per_device_quotas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(tmp_path / "c.toml")
    assert cli_main(["tenant", "add", "a", "--config", config, "--memory", "2GiB", "--device-memory", "1=8GiB",
                     "--device-memory", "3=1GiB"]) == 0
    assert load_config(config).tenants["a"].device_memory == {1: 8 << 30, 3: 1 << 30}
    assert cli_main(["tenant", "list", "--config", config]) == 0
    assert "1: 8GiB, 3: 1GiB" in capsys.readouterr().out
    assert cli_main(["tenant", "add", "b", "--config", config, "--device-memory", "one=8GiB"]) == 2
    assert "DEVICE=SIZE" in capsys.readouterr().err
