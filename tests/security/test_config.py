"""The config as an attack surface: loose types and silently dropped keys turn settings off; `tenant` commands must
edit the operator's file without losing what else is in it, and keep it private."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gpubroker.broker.config import load_config
from gpubroker.broker.front.auth import TokenVerifier
from gpubroker.client import InvalidArgument

CONFIG = '''\
# Operator's notes: rotated tokens every quarter.
[broker]
listen = ["unix:/run/gpubroker/gpubroker.sock"]   # the only listener
insecure = false

# Limits we agreed with team-a.
lease_seconds   = 30.0    # aligned by hand
max_shared_bytes_per_tenant = "8GiB"

# The first tenant.
[tenants.team-a]
token_id = "aaaaaaaaaaaa"   # rotated 2026-01
token_hash = "scrypt$16384$8$1$c2FsdA$aGFzaA"
memory = "1GiB"             # small on purpose

[tls]
cert_file = "/etc/gpubroker/tls/server.pem"   # renewed by certbot
key_file = "/etc/gpubroker/tls/server.key"
# end of the operator's file
'''


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", *args], capture_output=True, text=True,
                          timeout=60)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(("snippet", "words"), [
    # bool("false") is True: read loosely, this line would turn plaintext TCP on.
    ('[broker]\ninsecure = "false"', ["[broker] insecure", "expected bool", "got string 'false'"]),
    ('[broker]\nsandbox = "no"', ["[broker] sandbox", "expected bool"]),
    ('[broker]\nfair_scheduling = 0', ["[broker] fair_scheduling", "expected bool", "got int 0"]),
    ('[tls]\nrequire_client_cert = "true"', ["[tls] require_client_cert", "expected bool"]),
    ('[tenants.a]\ntoken_id = "x"\ntoken_hash = "y"\nadmin = 1', ["[tenants.a] admin", "expected bool"]),
    ('[broker]\nmax_shared_bytes_per_tenant = "lots"', ["[broker] max_shared_bytes_per_tenant", "expected a size"]),
    ('[broker]\nmax_kernel_seconds = -1.0', ["[broker] max_kernel_seconds", "expected number >= 0"]),
    ('[broker]\nworker_cpu_weight = 20000', ["[broker] worker_cpu_weight", "<= 10000"]),
    ('[broker]\nsocket_mode = 777', ["[broker] socket_mode", "octal", "got int 777"]),  # decimal 777 = 0o1411
    ('[broker]\ndevices = [0, -1]', ["[broker] devices", "int >= 0"]),
    ('[tls.identities]\n"spiffe://x/y" = 7', ["[tls.identities] spiffe://x/y", "got int 7"]),
    ('[tenants.a]\ntoken_id = "x"\ntoken_hash = "y"\nweight = 0', ["[tenants.a] weight", "int >= 1"]),
])
def test_a_wrong_type_or_range_is_refused_naming_the_file_table_key_and_type(tmp_path: Path, snippet: str,
                                                                              words: list[str]) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text(snippet + "\n")
    with pytest.raises(InvalidArgument) as info:
        load_config(path)
    assert info.value.message.startswith(f"{path}: ")
    for word in words:
        assert word in info.value.message


@pytest.mark.parametrize(("snippet", "message"), [
    ("[broker]\nmax_kernel_second = 3", "unknown key [broker] max_kernel_second; did you mean max_kernel_seconds?"),
    ("[broker]\ninsecur = false", "unknown key [broker] insecur; did you mean insecure?"),
    ("[tls]\nrequire_client_crt = true", "unknown key [tls] require_client_crt; did you mean require_client_cert?"),
    ('[tenants.a]\ntoken_id = "x"\ntoken_hash = "y"\nmemory_quota = "1GiB"',
     "unknown key [tenants.a] memory_quota; did you mean memory?"),
    ('[tenants.a]\ntoken_id = "x"\ntoken_hash = "y"\nadmn = true', "unknown key [tenants.a] admn; did you mean admin?"),
    ("[brokr]\nlease_seconds = 1.0", "unknown table brokr; did you mean [broker]?"),
    ("lease_seconds = 1.0", "unknown key lease_seconds; did you mean [broker] lease_seconds?"),
])
def test_an_unknown_key_is_refused_with_a_close_match(tmp_path: Path, snippet: str, message: str) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text(snippet + "\n")
    with pytest.raises(InvalidArgument) as info:
        load_config(path)
    assert info.value.message == f"{path}: {message}"


def test_serve_refuses_a_loose_boolean_before_listening(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text(f'[broker]\nlisten = ["unix:{tmp_path}/b.sock", "0.0.0.0:0"]\ninsecure = "false"\n')
    proc = _cli("serve", "--config", str(path))
    assert proc.returncode == 2
    assert "[broker] insecure: expected bool (true or false), got string 'false'" in proc.stderr
    assert not (tmp_path / "b.sock").exists()


def test_tenant_commands_edit_the_file_in_place(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text(CONFIG)
    path.chmod(0o640)  # a loose mode is tightened by the first edit: the file holds token hashes

    added = _cli("tenant", "add", "team-b", "--config", str(path), "--memory", "2GiB", "--weight", "3")
    assert added.returncode == 0, added.stderr
    token_b = added.stdout.strip().splitlines()[-1]
    text = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # Everything that was there is still there, in order and byte for byte; the new table follows team-a's.
    assert [line for line in _lines(text) if line in CONFIG.splitlines()] == _lines(CONFIG)
    assert text.index("[tenants.team-a]") < text.index("[tenants.team-b]") < text.index("[tls]")
    assert token_b not in text and token_b.split("_", 2)[2] not in text
    assert TokenVerifier(load_config(path)).tenant_for(token_b) == "team-b"

    rotated = _cli("tenant", "rotate-token", "team-a", "--config", str(path))
    assert rotated.returncode == 0, rotated.stderr
    token_a = rotated.stdout.strip().splitlines()[-1]
    after = path.read_text()
    cfg = load_config(path)
    assert TokenVerifier(cfg).tenant_for(token_a) == "team-a"
    # Only the two token lines changed, and their trailing comments stayed.
    changed = [(a, b) for a, b in zip(text.splitlines(), after.splitlines(), strict=True) if a != b]
    assert [b.split("=")[0].strip() for _, b in changed] == ["token_id", "token_hash"]
    assert changed[0][1].endswith("   # rotated 2026-01") and cfg.tenants["team-a"].token_id in changed[0][1]

    removed = _cli("tenant", "remove", "team-b", "--config", str(path))
    assert removed.returncode == 0, removed.stderr
    assert path.read_text() == after.replace(after[after.index("[tenants.team-b]"):after.index("[tls]")], "")
    assert set(load_config(path).tenants) == {"team-a"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    again = _cli("tenant", "remove", "team-b", "--config", str(path))
    assert again.returncode == 2 and "no tenant 'team-b'" in again.stderr
    # Nothing but the editor's own files in the directory: no temporary file left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpubroker.toml"]


def test_a_broken_file_is_not_edited(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    broken = CONFIG.replace("insecure = false", 'insecure = "false"')
    path.write_text(broken)
    before = path.stat()
    proc = _cli("tenant", "add", "team-b", "--config", str(path))
    assert proc.returncode == 2 and "[broker] insecure" in proc.stderr
    assert path.read_text() == broken and path.stat().st_ino == before.st_ino
    assert "gpb_" not in proc.stdout  # no token was shown for a tenant that was never stored


def test_tenant_add_creates_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "gpubroker.toml"
    old = os.umask(0o022)
    try:
        proc = _cli("tenant", "add", "team-x", "--config", str(path), "--admin", "--device-memory", "1=16GiB")
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = tomllib.loads(path.read_text())
    assert data["tenants"]["team-x"]["admin"] is True
    assert data["tenants"]["team-x"]["device_memory"] == {"1": "16GiB"}
    assert load_config(path).tenants["team-x"].quota_on(1) == 16 << 30


def test_concurrent_tenant_adds_lose_no_tenant(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text(CONFIG)
    names = [f"team-{i}" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-m", "gpubroker.broker.cli", "tenant", "add", name, "--config",
                               str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in names]
    tokens = {}
    for name, proc in zip(names, procs, strict=True):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        tokens[name] = out.strip().splitlines()[-1]
    cfg = load_config(path)
    assert set(cfg.tenants) == {"team-a", *names}
    verifier = TokenVerifier(cfg)
    assert all(verifier.tenant_for(token) == name for name, token in tokens.items())
    assert [line for line in _lines(path.read_text()) if line in CONFIG.splitlines()] == _lines(CONFIG)


def test_config_check_reads_as_serve_would_and_names_the_problem(tmp_path: Path) -> None:
    """`gpubroker config check`: 0 with a summary for a config `serve` would take; 2 naming the key for a typo
    (with the guess), plaintext on a non-loopback address without `insecure`, or a file that is not there."""
    path = tmp_path / "gpubroker.toml"
    assert _cli("tenant", "add", "team-a", "--config", str(path)).returncode == 0
    ok = _cli("config", "check", "--config", str(path))
    assert ok.returncode == 0 and ": OK: 1 tenants (0 admin)" in ok.stdout, ok
    listed = json.loads(_cli("tenant", "list", "--config", str(path), "--json").stdout)["tenants"]
    assert [(t["name"], t["memory"]) for t in listed] == [("team-a", 8 << 30)] and "token_hash" not in listed[0]
    text = path.read_text()
    path.write_text("[broker]\nlease_secnds = 30.0\n" + text)
    typo = _cli("config", "check", "--config", str(path))
    assert typo.returncode == 2 and "lease_secnds" in typo.stderr and "lease_seconds" in typo.stderr, typo
    path.write_text('[broker]\nlisten = ["0.0.0.0:0"]\n' + text)
    plaintext = _cli("config", "check", "--config", str(path))
    assert plaintext.returncode == 2 and "insecure" in plaintext.stderr, plaintext
    missing = _cli("config", "check", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "no config file at" in missing.stderr, missing


def test_a_stale_ready_file_never_says_a_broker_is_ready(tmp_path: Path) -> None:
    """The quickstart waits for --ready-file to exist: a previous run's file is removed as serve starts (and as it
    stops), so a broker that fails to start is not taken for a ready one."""
    path = tmp_path / "gpubroker.toml"
    assert _cli("tenant", "add", "team-a", "--config", str(path)).returncode == 0
    path.write_text(f'[broker]\nlisten = ["unix:{tmp_path}/b.sock", "0.0.0.0:0"]\n' + path.read_text())
    ready = tmp_path / "ready.json"
    ready.write_text('{"ports": ["unix:/a/previous/run.sock"], "pid": 1}')
    proc = _cli("serve", "--config", str(path), "--ready-file", str(ready))
    assert proc.returncode != 0 and "insecure" in proc.stderr, proc  # (plaintext on 0.0.0.0 refused at start)
    assert not ready.exists(), "the previous run's ready file is still there"


def test_config_keys_lists_every_key_with_what_it_does() -> None:
    """The wheel ships no example config: `gpubroker config keys` is where the written file's header and an
    unknown key's error point, and it lists every key of every table from the schema itself."""
    import msgspec

    from gpubroker.broker.config import BrokerSettings, TenantConfig, TlsConfig

    listed = _cli("config", "keys")
    assert listed.returncode == 0, listed
    lines = listed.stdout.splitlines()
    for struct in (BrokerSettings, TlsConfig, TenantConfig):
        for field in msgspec.structs.fields(struct):
            if field.encode_name == "name":
                continue  # (a tenant's name is its table's)
            line = next((line for line in lines if line.startswith(f"{field.encode_name} (")), None)
            assert line is not None and len(line.split("): ", 1)[-1]) > 10, (field.encode_name, line)


def test_a_token_file_holds_the_token_alone_and_privately(tmp_path: Path) -> None:
    """`tenant add --token-file`: the token goes into the file (mode 0600) and nowhere else, so a script cannot hide
    a failed add behind `| tail -n 1`; it authenticates as the tenant; rotate-token replaces it."""
    path, token_file = tmp_path / "gpubroker.toml", tmp_path / "me.token"
    added = _cli("tenant", "add", "me", "--config", str(path), "--token-file", str(token_file))
    assert added.returncode == 0 and "gpb_" not in added.stdout and str(token_file) in added.stdout, added
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert TokenVerifier(load_config(path)).tenant_for(token) == "me"
    again = _cli("tenant", "add", "me", "--config", str(path), "--token-file", str(token_file))
    assert again.returncode == 2 and token_file.read_text().strip() == token  # (a failed add leaves it)
    assert _cli("tenant", "rotate-token", "me", "--config", str(path), "--token-file", str(token_file)).returncode == 0
    assert token_file.read_text().strip() != token
    assert TokenVerifier(load_config(path)).tenant_for(token_file.read_text().strip()) == "me"
