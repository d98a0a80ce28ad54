"""The broker's TOML config: listen addresses, limits and tenants (tokens stored only as salted hashes).

The schema is three msgspec Structs, one per kind of table: ``BrokerSettings`` ([broker]), ``TlsConfig`` ([tls]
and [tls.identities]) and ``TenantConfig`` ([tenants.NAME]). Every field carries its type, its range and a
description (the config reference is generated from them), so a wrong type, a value out of range or an unknown key
is refused by name rather than read loosely. ``load_config`` reads a file with tomllib; ``save_config`` writes a
whole config (tests, the launcher); ``edit_config`` and the ``*_in_place`` helpers change an operator's file with
tomlkit, keeping its comments and layout (`gpubroker tenant add | remove | rotate-token`).
"""

from gpubroker.broker.config._edit import (
    add_tenant_in_place,
    edit_config,
    remove_tenant_in_place,
    rotate_token_in_place,
)
from gpubroker.broker.config._read import describe_keys, describe_type, load_config, parse_config
from gpubroker.broker.config._schema import (
    DEFAULT_SOCKET,
    BrokerConfig,
    BrokerSettings,
    TenantConfig,
    TlsConfig,
    format_size,
    parse_size,
    parse_uid_range,
)
from gpubroker.broker.config._write import save_config

__all__ = [
    "DEFAULT_SOCKET",
    "BrokerConfig",
    "BrokerSettings",
    "TenantConfig",
    "TlsConfig",
    "add_tenant_in_place",
    "describe_keys",
    "describe_type",
    "edit_config",
    "format_size",
    "load_config",
    "parse_config",
    "parse_size",
    "parse_uid_range",
    "remove_tenant_in_place",
    "rotate_token_in_place",
    "save_config",
]

