"""The configuration reference,
generated from the config schema (src/gpubroker/broker/config/_schema.py) at every build.

Each table of the config file is one msgspec Struct whose fields carry their type, range, default and description
(``Annotated[type, Meta(..., description=...), form] = default``). This renders them: a section per table
([broker], [tls], [tls.identities], [tenants.NAME]), each key as a definition with its type and allowed values
(``describe_type``, the words the broker's own error messages use), its default and its description. Nothing here
names a key, so a key added to the schema appears here, and a key without a description fails the build.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from gpubroker.broker.config import BrokerSettings, TenantConfig, TlsConfig, describe_type, format_size
from gpubroker.broker.config._schema import OCTAL, SIZE

__all__ = ["GENERATED", "TABLES", "config_reference", "table_keys"]

# (heading, the Struct, the keys it leaves to another section, the section's anchor, what the table is)
TABLES: tuple[tuple[str, type[msgspec.Struct], tuple[str, ...], str], ...] = (
    ("[broker]", BrokerSettings, (), "broker"),
    ("[tls]", TlsConfig, ("identities",), "tls"),
    ("[tls.identities]", TlsConfig, (), "tls-identities"),
    ("[tenants.NAME]", TenantConfig, ("name",), "tenants-name"),
)


def _extras(tp: Any) -> list[Any]:
    return list(typing.get_args(tp)[1:]) if typing.get_origin(tp) is Annotated else []


def description(field: msgspec.structs.FieldInfo) -> str:
    """The field's ``Meta(description=...)``; a field without one is an error (the reference would lack it)."""
    for extra in _extras(field.type):
        if isinstance(extra, Meta) and extra.description:
            return str(extra.description)
    raise ValueError(f"config key {field.encode_name!r} has no description in its Meta")


def _toml(value: Any, forms: list[Any]) -> str:
    """A default as it would be written in the config file."""
    if value is None:
        return "absent"
    if isinstance(value, bool):
        return "true" if value else "false"
    if SIZE in forms and isinstance(value, int):
        return f'"{format_size(value)}"' if format_size(value) != str(value) else str(value)
    if OCTAL in forms and isinstance(value, int):
        return f'"{value:o}"'
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return f"{value:g}" if value != int(value) else f"{value:.1f}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v, []) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v, forms)}" for k, v in value.items()) + " }" if value else "{}"
    return str(value)


def default(field: msgspec.structs.FieldInfo) -> str | None:
    """The default as TOML text, or None for a required key."""
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return None
    return _toml(value, _extras(field.type))


def table_keys(heading: str) -> list[msgspec.structs.FieldInfo]:
    """The fields documented under one section heading (e.g. "[broker]")."""
    for name, struct, leave_out, _anchor in TABLES:
        if name == heading:
            if heading == "[tls.identities]":
                return [f for f in msgspec.structs.fields(struct) if f.encode_name == "identities"]
            return [f for f in msgspec.structs.fields(struct) if f.encode_name not in leave_out]
    raise KeyError(heading)


def _escape(text: str) -> str:
    """Plain text for markdown: ``<socket>`` is no HTML tag, ``*`` no emphasis."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def _definition(key: str, anchor: str, kind: str, dflt: str | None, text: str) -> Iterator[str]:
    yield f"`{key}`{{ #{anchor} }}"
    shown = "none: the key is required" if dflt is None else "absent" if dflt == "absent" else f"`{dflt}`"
    yield f":   *{_escape(kind)}*; default {shown}"
    yield ""
    yield f"    {_escape(text)}"
    yield ""


def _section(heading: str, struct: type[msgspec.Struct], anchor: str) -> Iterator[str]:
    yield f"### `{heading}` {{ #{anchor} }}"
    yield ""
    doc = (struct.__doc__ or "").strip().split("\n\n")[0].replace("``", "`")
    if heading == "[tls.identities]":
        (field,) = table_keys(heading)
        value_type = typing.get_args(typing.get_args(field.type)[0])[1]  # dict[str, <this>]
        text = description(field).removeprefix("[tls.identities]: ")
        yield text[:1].upper() + text[1:]
        yield ""
        yield from _definition("\"SAN URI or CN\"", "tls-identities-entry", describe_type(value_type), "{}",
                               "Each key is a client certificate's identity (its SAN URI, or its CN); each value "
                               "the tenant that certificate authenticates as.")
        return
    yield " ".join(doc.split())
    yield ""
    if heading == "[tenants.NAME]":
        name = next(f for f in msgspec.structs.fields(struct) if f.encode_name == "name")
        yield f"NAME: {description(name)}"
        yield ""
    for field in table_keys(heading):
        yield from _definition(field.encode_name, f"{anchor}-{field.encode_name.replace('_', '-')}",
                               describe_type(field.type), default(field), description(field))


def config_reference() -> str:
    """Markdown: every table and key of the config, from the schema."""
    lines: list[str] = []
    for heading, struct, _leave_out, anchor in TABLES:
        lines.extend(_section(heading, struct, anchor))
    return "\n".join(lines).rstrip() + "\n"


GENERATED: dict[str, Callable[[], str]] = {"config-reference": config_reference}
