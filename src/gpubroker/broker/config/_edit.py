"""Editing an operator's config in place: ``edit_config`` and the ``*_in_place`` helpers.

They keep the file's comments, order and layout (`gpubroker tenant add | remove | rotate-token`), and replace it
atomically only once the edited text loads to the tenants intended.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpubroker.broker.config._read import load_config, parse_config
from gpubroker.broker.config._schema import BrokerConfig, TenantConfig
from gpubroker.broker.config._write import _HEADER, _tenant_table, _write
from gpubroker.wire.errors import InvalidArgument, NotFound

__all__ = ["add_tenant_in_place", "edit_config", "remove_tenant_in_place", "rotate_token_in_place"]

if TYPE_CHECKING:  # imported where used: tomlkit is the broker's (the `broker` extra), and the CLI's client
    import tomlkit  # commands import this package on a client-only install


@contextlib.contextmanager
def edit_config(path: str | os.PathLike[str]) -> Iterator[tuple[tomlkit.TOMLDocument, BrokerConfig]]:
    """Change an operator's file keeping its comments, order and layout.

    Yields the file as a tomlkit document and as a validated BrokerConfig (the caller changes both the same way).
    On a clean exit the edited document must load, and load to the same tenants as the BrokerConfig; then it
    replaces the file atomically (mode 0600). A missing file starts as a short header. Concurrent editors of
    the same directory take turns (flock on the directory), so neither loses the other's tenant.
    """
    import tomlkit

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    dirfd = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(dirfd, fcntl.LOCK_EX)
        cfg = load_config(target)
        if target.exists():
            doc = tomlkit.parse(target.read_text())
        else:
            doc = tomlkit.document()
            doc.add(tomlkit.comment(_HEADER))
        yield doc, cfg
        text = doc.as_string()
        edited = parse_config(tomllib.loads(text), f"{target} (as edited)", target)
        if edited.tenants != cfg.tenants:
            raise InvalidArgument(f"{target}: the edit did not give the tenants intended; the file is unchanged")
        _write(target, text)
        cfg.path = target
    finally:
        os.close(dirfd)  # releases the lock


def _tenants_table(doc: tomlkit.TOMLDocument) -> Any:
    import tomlkit

    if "tenants" not in doc:
        doc.add("tenants", tomlkit.table(is_super_table=True))
    return doc["tenants"]


def add_tenant_in_place(path: str | os.PathLike[str], tenant: TenantConfig) -> Path:
    """Append a ``[tenants.NAME]`` table to the file; AlreadyExists if the tenant is there."""
    import tomlkit

    with edit_config(path) as (doc, cfg):
        cfg.add_tenant(tenant)
        table = _tenant_table(tenant)
        table.add(tomlkit.nl())  # a blank line before whatever table follows it
        _tenants_table(doc)[tenant.name] = table
    return Path(path)


def remove_tenant_in_place(path: str | os.PathLike[str], name: str) -> Path:
    """Delete the tenant's table (the rest of the file as it was); NotFound if there is none."""
    with edit_config(path) as (doc, cfg):
        cfg.remove_tenant(name)
        del _tenants_table(doc)[name]
        if not doc["tenants"]:
            del doc["tenants"]
    return Path(path)


def rotate_token_in_place(path: str | os.PathLike[str], name: str, token_id: str, token_hash: str) -> Path:
    """Replace the tenant's token_id and token_hash where they stand; NotFound if there is no such tenant."""
    with edit_config(path) as (doc, cfg):
        if name not in cfg.tenants:
            raise NotFound(f"no tenant {name!r}")
        tenant = cfg.tenants[name]
        tenant.token_id, tenant.token_hash = token_id, token_hash
        table = _tenants_table(doc)[name]
        table["token_id"] = token_id
        table["token_hash"] = token_hash
    return Path(path)
