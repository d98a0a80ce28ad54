"""Reading a config: ``load_config`` (a file, with tomllib) and ``parse_config`` (a parsed document).

A wrong type, a value out of range or an unknown key is refused by name (an InvalidArgument naming the file, the
table and the key, with a close match where there is one); ``describe_type`` says a field's type as an operator
reads it, for those messages and the config reference.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gpubroker.broker.config._schema import (
    _NAME,
    OCTAL,
    ONE_OR_MORE,
    SIZE,
    BrokerConfig,
    BrokerSettings,
    TenantConfig,
    TlsConfig,
    _Form,
    parse_size,
    parse_uid_range,
)
from gpubroker.wire.addresses import parse_host_port
from gpubroker.wire.errors import InvalidArgument

__all__ = ["describe_type", "load_config", "parse_config"]

log = logging.getLogger("gpubroker.config")


def _fields(struct: type[msgspec.Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    """A Struct's fields by their TOML name."""
    return {f.encode_name: f for f in msgspec.structs.fields(struct)}


_BROKER_KEYS = _fields(BrokerSettings)
# Keys that once were, and what replaced them: refused with that, not as unknown.
_REPLACED = {"broker": {
    "worker_uid": ("replaced by worker_uids, a range of host uids (each worker runs as one of its own, which no "
                   "other worker shares): remove worker_uid; the default range suits most hosts, and worker_uids "
                   "= \"0\" runs the workers as root, as worker_uid = 0 did"),
}}
_TLS_KEYS = _fields(TlsConfig)
_TENANT_KEYS = {k: f for k, f in _fields(TenantConfig).items() if k != "name"}  # the name is the table's


def _forms(field: msgspec.structs.FieldInfo) -> list[Any]:
    return list(getattr(field.type, "__metadata__", ()))


def describe_type(tp: Any) -> str:
    """A field's type as an operator reads it: ``int >= 1``, ``bool (true or false)``, ``"auto" | "cuda"``."""
    if typing.get_origin(tp) is Annotated:
        base, *extras = typing.get_args(tp)
        forms = [e for e in extras if isinstance(e, _Form)]
        if SIZE in forms and typing.get_origin(base) is dict:
            key, _ = typing.get_args(base)
            return f"a table of {describe_type(key)} = size (an int of bytes or a string like \"8GiB\")"
        if SIZE in forms:
            text = "a size (an int of bytes, or a string like \"8GiB\")"
        elif OCTAL in forms:
            text = "an octal mode (a string like \"660\", or an int like 0o660)"
        elif ONE_OR_MORE in forms:
            text = "a string or a list of strings"
        else:
            text = describe_type(base)
        bounds = []
        for meta in extras:
            if isinstance(meta, Meta):
                for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                    value = getattr(meta, name)
                    if value is not None and not (OCTAL in forms and name == "ge"):
                        shown = oct(value) if OCTAL in forms else value if isinstance(value, int) else f"{value:g}"
                        bounds.append(f"{sign} {shown}")
                if meta.min_length is not None:
                    bounds.append("(not empty)" if meta.min_length == 1 else f"(at least {meta.min_length})")
                if meta.pattern is not None and meta.pattern == _NAME.pattern:
                    bounds.append("of 1-64 [A-Za-z0-9_.-]")
        return text + (" " + ", ".join(bounds) if bounds else "")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args if a is not type(None))
    if origin is list:
        return f"a list of {describe_type(args[0])}"
    if origin is dict:
        return f"a table of {describe_type(args[0])} = {describe_type(args[1])}"
    simple = {bool: "bool (true or false)", int: "int", float: "number", str: "string"}
    return simple.get(tp, getattr(tp, "__name__", str(tp)))


def _toml_type(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, list):
        return "array"
    return {int: "int", float: "float", str: "string"}.get(type(value), type(value).__name__)


class _Where:
    """Names what is being read in every message: the file and the table."""

    def __init__(self, source: str, table: str) -> None:
        self.source = source
        self.table = table

    def error(self, key: str, message: str, **details: Any) -> InvalidArgument:
        return InvalidArgument(f"{self.source}: [{self.table}] {key}: {message}", file=self.source,
                               table=self.table, key=key, **details)

    def wrong_type(self, key: str, field: msgspec.structs.FieldInfo, value: object, why: str = "") -> InvalidArgument:
        expected = describe_type(field.type)
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return self.error(key, f"expected {expected}, got {_toml_type(value)} {shown}" + (f" ({why})" if why else ""),
                          expected=expected)

    def unknown(self, key: str, known: list[str]) -> InvalidArgument:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = (f"; did you mean {close[0]}?" if close else f"; the keys of [{self.table}] are: {', '.join(known)}"
                if len(known) <= 12 else "; `gpubroker config keys` lists every key")
        return InvalidArgument(f"{self.source}: unknown key [{self.table}] {key}{hint}", file=self.source,
                               table=self.table, key=key, suggestion=close[0] if close else "")


def _normalize(where: _Where, table: dict[str, Any], fields: dict[str, msgspec.structs.FieldInfo]) -> dict[str, Any]:
    """Refuse unknown keys (naming a close match) and turn the TOML forms a field allows into its type."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        field = fields.get(key)
        if field is None and key in _REPLACED.get(where.table, {}):
            raise where.error(key, _REPLACED[where.table][key])
        if field is None:
            raise where.unknown(key, list(fields))
        forms = _forms(field)
        try:
            if SIZE in forms and isinstance(value, dict):
                value = {k: parse_size(v) if isinstance(v, str) else v for k, v in value.items()}
            elif SIZE in forms and isinstance(value, str):
                value = parse_size(value)
            elif OCTAL in forms and isinstance(value, str):
                value = int(value, 8)
            elif ONE_OR_MORE in forms and isinstance(value, str):
                value = [value]
        except (InvalidArgument, ValueError):
            raise where.wrong_type(key, field, table[key]) from None
        out[key] = value
    return out


def _convert(where: _Where, data: dict[str, Any], struct: type[msgspec.Struct],
             fields: dict[str, msgspec.structs.FieldInfo], original: dict[str, Any]) -> Any:
    try:
        return msgspec.convert(data, struct, str_keys=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = re.search(r"`\$\.(\w+)(\S*)`", text)
        missing = re.match(r"Object missing required field `(\w+)`", text)
        if missing:
            raise InvalidArgument(f"{where.source}: [{where.table}] lacks {missing.group(1)}", file=where.source,
                                  table=where.table, key=missing.group(1)) from None
        if match and match.group(1) in fields:
            key = match.group(1)
            # Within a list or a table: msgspec's own words say which element was wrong, and how.
            deeper = match.group(2) or " in `" in text
            detail = text.split(" - at ")[0]
            raise where.wrong_type(key, fields[key], original.get(key),
                                   detail[:1].lower() + detail[1:] if deeper else "") from None
        raise InvalidArgument(f"{where.source}: [{where.table}]: {text}", file=where.source,
                              table=where.table) from None


def _check_broker(where: _Where, s: BrokerSettings) -> None:
    """The rules that span keys or need more than a type and a range."""
    if s.chunk_bytes + 4096 > s.max_message_bytes:
        raise where.error("chunk_bytes", f"must leave 4096 bytes of room under max_message_bytes "
                          f"({s.max_message_bytes}), got {s.chunk_bytes}")
    if s.devices is not None and len(set(s.devices)) != len(s.devices):
        raise where.error("devices", f"must list distinct device indices, got {s.devices}")
    for key in ("metrics_listen", "link_listen"):  # HOST:PORT, or empty (off)
        address = getattr(s, key).strip()
        if address:
            try:
                parse_host_port(address)
            except ValueError as exc:
                raise where.error(key, str(exc)) from None
        setattr(s, key, address)
    for address in s.listen:
        if not address.strip():
            raise where.error("listen", "an address is empty (expected unix:PATH or HOST:PORT)")
    try:
        parse_uid_range(s.worker_uids)
    except ValueError as exc:
        raise where.error("worker_uids", str(exc)) from None


def parse_config(data: dict[str, Any], source: str = "<config>", path: Path | None = None) -> BrokerConfig:
    """A BrokerConfig from a parsed TOML document; every problem is an InvalidArgument naming the key."""
    for key, value in data.items():
        if key not in ("broker", "tls", "tenants"):
            close = difflib.get_close_matches(key, ["broker", "tls", "tenants"], n=1, cutoff=0.6)
            hint = (f"; did you mean [{close[0]}]?" if close else f"; did you mean [broker] {key}?"
                    if key in _BROKER_KEYS else "; the tables are [broker], [tls] and [tenants.NAME]")
            raise InvalidArgument(f"{source}: unknown {'table' if isinstance(value, dict) else 'key'} {key}{hint}",
                                  file=source, key=key)
        if not isinstance(value, dict):
            raise InvalidArgument(f"{source}: {key} must be a table ([{key}]), got {_toml_type(value)}",
                                  file=source, key=key)
    where = _Where(source, "broker")
    broker = data.get("broker", {})
    settings: BrokerSettings = _convert(where, _normalize(where, broker, _BROKER_KEYS), BrokerSettings, _BROKER_KEYS,
                                        broker)
    _check_broker(where, settings)
    cfg = BrokerConfig(**msgspec.structs.asdict(settings), path=path)
    if "tls" in data:
        where = _Where(source, "tls")
        tls = data["tls"]
        identities = tls.get("identities", {})
        if isinstance(identities, dict):
            # The identities' own table: each value names a tenant, so a wrong type is named by its key there.
            ids = _Where(source, "tls.identities")
            for identity, tenant in identities.items():
                if not isinstance(tenant, str) or not _NAME.match(tenant):
                    raise ids.error(identity, f"expected a tenant's name (a string of 1-64 [A-Za-z0-9_.-]), got "
                                    f"{_toml_type(tenant)} {tenant!r}", expected="a tenant's name")
        cfg.tls = _convert(where, _normalize(where, tls, _TLS_KEYS), TlsConfig, _TLS_KEYS, tls)
    for name, table in data.get("tenants", {}).items():
        where = _Where(source, f"tenants.{name}")
        if not isinstance(table, dict):
            raise InvalidArgument(f"{source}: [tenants] {name}: expected a table [tenants.{name}], got "
                                  f"{_toml_type(table)}", file=source, table="tenants", key=name)
        if not _NAME.match(name):
            raise InvalidArgument(f"{source}: [tenants.{name}]: a tenant's name is 1-64 of [A-Za-z0-9_.-]",
                                  file=source, table=f"tenants.{name}")
        tenant = _convert(where, {**_normalize(where, table, _TENANT_KEYS), "name": name}, TenantConfig,
                          _TENANT_KEYS, table)
        cfg.add_tenant(tenant)
    if cfg.tls is not None:
        for identity, tenant_name in cfg.tls.identities.items():
            if tenant_name not in cfg.tenants:
                # Not an error: `tenant remove` leaves the mapping, which then authenticates nobody.
                close = difflib.get_close_matches(tenant_name, list(cfg.tenants), n=1, cutoff=0.6)
                log.warning("%s: [tls.identities] %r maps to %r, which is no tenant%s", source, identity,
                            tenant_name, f" (did you mean {close[0]!r}?)" if close else "")
    return cfg


def load_config(path: str | os.PathLike[str]) -> BrokerConfig:
    """Read a config; a missing file is an empty config (so `tenant add` can create it)."""
    path = Path(path)
    if not path.exists():
        return BrokerConfig(path=path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: {exc}", file=str(path)) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot read it: {exc}", file=str(path)) from None
    return parse_config(data, str(path), path)


def describe_keys() -> list[tuple[str, str, str, str]]:
    """Every key a config may hold: (table, key, its type, its description), as `gpubroker config keys` prints them
    (the wheel ships no example file: the schema itself is the list)."""
    rows = []
    for table, keys in (("broker", _BROKER_KEYS), ("tls", _TLS_KEYS), ("tenants.NAME", _TENANT_KEYS)):
        for key, field in keys.items():
            meta = next((m for m in getattr(field.type, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)
            rows.append((table, key, describe_type(field.type), (meta.description or "") if meta else ""))
    return rows
