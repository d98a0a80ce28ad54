"""The docs' generated parts against what they describe: every config key, every metric family a broker serves."""

from __future__ import annotations

import importlib.util
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
from msgspec import Meta
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.broker.config import BrokerSettings, TenantConfig, TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect

HOOKS = Path(__file__).resolve().parents[2] / "docs" / "_hooks"
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local endpoint: never via a proxy


def _hook(name: str) -> ModuleType:
    """A module of docs/_hooks, loaded as the build loads it (generate.py's ``load``, after generate.py itself)."""
    if "gpubroker_docs_generate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpubroker_docs_generate", HOOKS / "generate.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    generate = sys.modules["gpubroker_docs_generate"]
    return generate if name == "generate" else generate.load(name)


def _generated(name: str) -> str:
    table: dict[str, Callable[[], str]] = _hook("generate").generators()
    return table[name]()


def _description(field: msgspec.structs.FieldInfo) -> str:
    metas = [m for m in getattr(field.type, "__metadata__", ()) if isinstance(m, Meta)]
    return next((str(m.description) for m in metas if m.description), "")


# (the section's anchor in the reference, the Struct, keys documented elsewhere)
TABLES = [("broker", BrokerSettings, ()), ("tls", TlsConfig, ("identities",)),
          ("tenants-name", TenantConfig, ("name",))]


@pytest.mark.parametrize(("anchor", "struct", "elsewhere"), TABLES, ids=[t[0] for t in TABLES])
def test_every_config_key_is_in_the_reference_with_its_description(
        anchor: str, struct: type[msgspec.Struct], elsewhere: tuple[str, ...]) -> None:
    reference = _generated("config-reference")
    escape = _hook("gen_config")._escape
    assert f"{{ #{anchor} }}" in reference
    fields = msgspec.structs.fields(struct)
    assert fields
    for field in fields:
        text = _description(field)
        assert text, f"[{anchor}] {field.encode_name} has no description (Meta(description=...))"
        if field.encode_name in elsewhere:
            continue
        entry = f"`{field.encode_name}`{{ #{anchor}-{field.encode_name.replace('_', '-')} }}"
        assert entry in reference, f"{field.encode_name} is missing from the config reference"
        after = reference.split(entry, 1)[1].split("\n`", 1)[0]  # this key's definition, up to the next key's
        assert escape(text) in after, f"{field.encode_name}'s description is not under it in the reference"


def test_tls_identities_and_tenant_names_are_described() -> None:
    reference = _generated("config-reference")
    for struct, key in ((TlsConfig, "identities"), (TenantConfig, "name")):
        field = next(f for f in msgspec.structs.fields(struct) if f.encode_name == key)
        assert _description(field).removeprefix("[tls.identities]: ")[1:] in reference
    assert "{ #tls-identities }" in reference


def test_every_metric_family_of_a_live_scrape_is_in_the_metrics_list(backend: str) -> None:
    listed = _generated("metrics-list")
    settings: dict[str, object] = {"metrics_listen": "127.0.0.1:0"}
    with (BrokerProcess([TenantSpec("alice")], backend=backend, settings=settings) as proc,
          connect(proc.target, token=proc.tokens["alice"]) as gpu):  # a session and an RPC: every family has samples
        gpu.allocate_memory(1 << 20)
        with _HTTP.open(proc.metrics_url, timeout=30) as response:
            text = response.read().decode()
    families = list(text_string_to_metric_families(text))
    ours = [f for f in families if f.name.startswith("gpubroker_")]
    # The collector's 15 families and the RPC histogram; process_* are prometheus_client's own, named on the page.
    assert len(ours) >= 16
    assert all(f.name.startswith(("gpubroker_", "process_")) for f in families), [f.name for f in families]
    for family in ours:
        names = {s.name for s in family.samples} or {family.name}
        for name in names:
            assert f"`{name}`" in listed, f"{name} ({family.type}) is served but not in the docs' metrics list"
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation times of a histogram's series: listed with the histogram
        row = next(line for line in listed.splitlines() if f"`{family.name}" in line)
        assert f"| {family.type} |" in row, f"{family.name}: served as a {family.type}, listed as {row}"
        assert family.documentation.replace("|", "/") in row, f"{family.name}: help string differs"
    # And nothing listed that a broker does not serve.
    served = {s for f in ours for s in ({x.name for x in f.samples} or {f.name})}
    listed_names = {part.strip().strip("`") for line in listed.splitlines()[2:]
                    for part in line.split("|")[1].split("<br>")}
    assert listed_names <= served, f"listed but not served: {sorted(listed_names - served)}"


def test_every_command_and_option_of_the_cli_is_in_its_reference() -> None:
    """The command-line reference comes from the parser itself: each command has its section and usage, each
    option its row, and a command added to cli.py shows up without a docs change."""
    import argparse

    reference = _generated("cli-reference")
    commands = list(_hook("gen_cli").commands())
    names = {" ".join(path) for path, _, _ in commands}
    assert {"gpubroker serve", "gpubroker tenant add", "gpubroker config check", "gpubroker undrain",
            "gpubroker usage", "gpubroker devices", "gpubroker bench"} <= names
    for path, _, parser in commands:
        assert f"## `{' '.join(path)}` {{ #{'-'.join(path)} }}" in reference
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in reference, f"{' '.join(path)} {option}"
