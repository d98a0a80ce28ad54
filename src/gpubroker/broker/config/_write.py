"""Writing a whole config: ``save_config`` renders it with tomlkit and replaces the file atomically (mode 0600)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gpubroker.broker.config._read import _BROKER_KEYS, _TENANT_KEYS, _TLS_KEYS, _forms, parse_config
from gpubroker.broker.config._schema import OCTAL, SIZE, BrokerConfig, TenantConfig, format_size

__all__ = ["save_config"]

if TYPE_CHECKING:  # imported where used: tomlkit is the broker's (the `broker` extra), and the CLI's client
    import tomlkit  # commands import this package on a client-only install

_HEADER = ("gpubroker config (`gpubroker config keys` lists every setting). It holds token hashes: "
           "keep it mode 0600.")


def _toml(field: msgspec.structs.FieldInfo, value: Any) -> Any:
    """A value as the file shows it: sizes with a unit where exact, modes in octal."""
    forms = _forms(field)
    if SIZE in forms and isinstance(value, dict):
        return _inline({str(k): _size(v) for k, v in sorted(value.items())})
    if SIZE in forms:
        return _size(value)
    if OCTAL in forms:
        return f"{value:o}"
    if isinstance(value, dict):
        return _inline({str(k): v for k, v in value.items()})
    return value


def _inline(values: dict[str, Any]) -> tomlkit.items.InlineTable:
    import tomlkit

    table = tomlkit.inline_table()
    table.update(values)
    return table


def _size(n: int) -> str | int:
    text = format_size(n)
    return text if not text.isdigit() else n


def _tenant_table(tenant: TenantConfig) -> tomlkit.items.Table:
    """A ``[tenants.NAME]`` table for ``tenant``, defaults left out except its memory and weight."""
    import tomlkit

    table = tomlkit.table()
    for key, field in _TENANT_KEYS.items():
        value = getattr(tenant, field.name)
        if key in ("token_id", "token_hash", "memory", "weight") or value != _default(field):
            table.add(key, _toml(field, value))
    return table


def _default(field: msgspec.structs.FieldInfo) -> Any:
    return field.default_factory() if field.default is msgspec.NODEFAULT else field.default


def _render(cfg: BrokerConfig) -> str:
    import tomlkit

    doc = tomlkit.document()
    doc.add(tomlkit.comment(_HEADER))
    broker = tomlkit.table()
    for key, field in _BROKER_KEYS.items():
        value = getattr(cfg, field.name)
        if value is not None:
            broker.add(key, _toml(field, value))
    doc.add("broker", broker)
    if cfg.tls is not None:
        tls = tomlkit.table()
        for key, field in _TLS_KEYS.items():
            if key != "identities":
                tls.add(key, getattr(cfg.tls, field.name))
        if cfg.tls.identities:
            ids = tomlkit.table()
            for identity, tenant_name in cfg.tls.identities.items():
                ids.add(identity, tenant_name)
            tls.add("identities", ids)
        doc.add("tls", tls)
    if cfg.tenants:
        tenants = tomlkit.table(is_super_table=True)
        for tenant in cfg.tenants.values():
            tenants.add(tenant.name, _tenant_table(tenant))
        doc.add("tenants", tenants)
    return doc.as_string()


def _write(target: Path, text: str) -> None:
    """Replace ``target`` atomically with a 0600 file (it holds token hashes), keeping its owner where allowed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        owner = target.stat()
    except FileNotFoundError:
        owner = None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            if owner is not None and (owner.st_uid, owner.st_gid) != (os.getuid(), os.getgid()):
                # root editing the broker's own file: the broker (User=gpubroker) must still read it.
                with contextlib.suppress(PermissionError):
                    os.fchown(f.fileno(), owner.st_uid, owner.st_gid)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash only once the directory is synced
        dirfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


def save_config(cfg: BrokerConfig, path: str | os.PathLike[str] | None = None) -> Path:
    """Write a whole config atomically with mode 0600; the result is read back first, so it always loads."""
    target = Path(path or cfg.path or "gpubroker.toml")
    text = _render(cfg)
    parse_config(tomllib.loads(text), f"{target} (as written)", target)  # a bad setattr fails here, by its key
    _write(target, text)
    cfg.path = target
    return target
