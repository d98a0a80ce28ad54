"""`gpubroker`: serve, manage tenants, list devices, run the demo and the benchmark."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpubroker import __version__
from gpubroker.broker.admin_cli import TARGET_ENV, add_admin_parsers, human_size
from gpubroker.broker.config import (
    DEFAULT_SOCKET,
    BrokerConfig,
    TenantConfig,
    add_tenant_in_place,
    format_size,
    load_config,
    parse_size,
    remove_tenant_in_place,
    rotate_token_in_place,
)
from gpubroker.broker.front.auth import mint_token
from gpubroker.broker.logs import configure_logging, json_logging
from gpubroker.client import (
    Aborted,
    Cancelled,
    DeadlineExceeded,
    GpuBrokerError,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    WorkerCrashed,
)
from gpubroker.wire.addresses import parse_host_port

__all__ = ["main"]

audit = logging.getLogger("gpubroker.audit")

# The modules of the `broker` extra (pyproject.toml): what a client-only install lacks.
BROKER_MODULES = frozenset({"cryptography", "uvloop", "prometheus_client", "tomlkit", "pyseccomp", "grpc_reflection",
                            "google.rpc"})


def _existing_config(path: str) -> BrokerConfig:
    """The config `serve` reads (load_config reads a missing file as no tenants, for `tenant add`: a broker would
    serve nobody from a typo)."""
    if not os.path.exists(path):
        raise InvalidArgument(f"no config file at {path}: create it with `gpubroker tenant add NAME --config "
                              f"{path}`, or give the path of an existing one")
    return load_config(path)


def _cmd_config_check(args: argparse.Namespace) -> int:
    from gpubroker.broker.front import check_listeners

    cfg = _existing_config(args.config)  # (strict: unknown keys with a guess, types, ranges, every table's rules)
    check_listeners(cfg)  # (TLS files, plaintext only on loopback unless insecure, vsock's Unix listener)
    admins = sum(t.admin for t in cfg.tenants.values())
    print(f"{args.config}: OK: {len(cfg.tenants)} tenants ({admins} admin); listens on {', '.join(cfg.listen)}"
          f"{'; TLS' + (' with client certificates' if cfg.tls.client_ca_file else '') if cfg.tls else ''}; "
          f"backend {cfg.backend}. Devices and the sandbox are checked as the broker starts "
          f"(`gpubroker devices --config {args.config}` shows both here).")
    return 0


def _cmd_config_keys(args: argparse.Namespace) -> int:
    from gpubroker.broker.config import describe_keys

    table = None
    for name, key, kind, description in describe_keys():
        if args.table and not name.startswith(args.table):
            continue
        if name != table:
            print(f"{'' if table is None else chr(10)}[{name}]")
            table = name
        print(f"{key} ({kind}): {description}")
    return 0


def _warn(message: str) -> None:
    """A warning on stderr: a log line where the log is JSON lines, else ``gpubroker: warning: ...``."""
    if json_logging():
        logging.getLogger("gpubroker").warning("%s", message)
    else:
        print(f"gpubroker: warning: {message}", file=sys.stderr)


def _cmd_serve(args: argparse.Namespace) -> int:
    from gpubroker.broker.front import capture_native_stderr, run_broker
    from gpubroker.broker.sandbox import set_dumpable

    cfg = _existing_config(args.config)
    if args.listen:
        cfg.listen = args.listen
    if args.backend:
        cfg.backend = args.backend
    if args.insecure:
        cfg.insecure = True
    if args.no_sandbox:
        cfg.sandbox = False
    if args.vsock_port is not None:
        cfg.vsock_port = args.vsock_port
    if args.metrics_listen is not None:
        cfg.metrics_listen = args.metrics_listen
    if args.log_format:
        cfg.log_format = args.log_format
    # gRPC core's own lines (a peer's bad metadata, one a call) through the log, rate-limited: before the handler
    # takes sys.stderr, which becomes the real stderr.
    capture_native_stderr()
    configure_logging(cfg.log_format, verbose=args.verbose)
    os.environ["GPUBROKER_LOG_FORMAT"] = cfg.log_format  # for the workers it starts
    # The front holds every tenant's tokens in memory: no same-uid process may ptrace it or read /proc/<pid>/mem.
    set_dumpable(False)
    if not cfg.tenants:
        _warn(f"{args.config} has no tenants; add one with `gpubroker tenant add`")
    run_broker(cfg, ready_file=args.ready_file)
    return 0


def _device_memory(items: list[str] | None) -> dict[int, int]:
    """``["1=16GiB", ...]`` (from --device-memory) as {device index: bytes}."""
    quotas = {}
    for item in items or ():
        device, sep, size = item.partition("=")
        if not sep or not device.strip().isdigit():
            raise InvalidArgument(f"--device-memory takes DEVICE=SIZE (e.g. 1=16GiB), not {item!r}")
        quotas[int(device)] = parse_size(size)
    return quotas


def _cmd_tenant_add(args: argparse.Namespace) -> int:
    token = mint_token()
    tenant = TenantConfig(name=args.name, token_id=token.token_id, token_hash=token.token_hash,
                          memory_quota=parse_size(args.memory), weight=args.weight, admin=args.admin,
                          device_memory=_device_memory(args.device_memory),
                          shared_memory_quota=parse_size(args.shared_memory) if args.shared_memory else None,
                          certificates_since=round(time.time(), 3))
    # In place: the operator's comments and layout stay as they were; only the new table is appended.
    path = add_tenant_in_place(args.config, tenant)
    audit.info("action=tenant-add tenant=%s config=%s admin=%s by=%s", args.name, path, args.admin, _who())
    return _reload_then_give_token(args, path, "added", "serves it", token.token,
                                   f"added tenant {args.name!r} to {path} (memory "
                                   f"{format_size(tenant.memory_quota)}, weight {args.weight}).")


# What each edit of the tenants tells when nothing reloaded the broker.
_RELOAD_HINT = ("A running broker {what} after a reload: `gpubroker reload` (an admin's token), SIGHUP or "
                "`systemctl reload gpubroker`, or this command's --reload.")


def _reload_then_give_token(args: argparse.Namespace, path: Path, seen: str, what: str, token: str, done: str) -> int:
    """After an edit that made ``token``: the reload (``_reload_after_edit``), then what was ``done`` and the token,
    whatever the reload did, Ctrl-C included (the token is shown only now). The exit status."""
    reloaded, status = "Not reloaded: interrupted.", 130
    try:
        reloaded, status = _reload_after_edit(args, path, seen, what)
    finally:
        print(f"{done} {reloaded}", end=" ")
        _give_token(token, args.token_file)
    return status


def _reload_after_edit(args: argparse.Namespace, path: Path, seen: str, what: str) -> tuple[str, int]:
    """With --reload, the running broker at --target re-reads its tenants now, through its Admin service with the
    admin token in GPUBROKER_TOKEN: what happened, for the operator, and the exit status it makes (1 unless the
    reload saw this tenant among those it ``seen``: "added", "changed" or "removed"; a broker that reads another
    file did not). The edit stands either way (the first admin has no token yet: it comes by SIGHUP,
    docs/operator/tenants.md)."""
    if not args.reload:
        return _RELOAD_HINT.format(what=what), 0
    token = os.environ.get("GPUBROKER_TOKEN", "")
    if not token:
        return ("Not reloaded: --reload needs an admin tenant's token in GPUBROKER_TOKEN. The first admin comes by "
                "a signal instead: SIGHUP to the broker, or `systemctl reload gpubroker`."), 1
    from gpubroker.client import AdminClient

    try:
        with AdminClient(args.target, token) as admin:
            answer = admin.reload()
    except Exception as exc:  # (a refusal, or a target that is no address: the edit and its token stand)
        return f"Not reloaded ({type(exc).__name__}): {exc}", 1
    did = (f"added {list(answer.added)}, removed {list(answer.removed)}, changed {list(answer.changed)}, "
           f"{answer.sessions_ended} sessions ended")
    if args.name not in getattr(answer, seen):
        return (f"The broker at {args.target} reloaded ({did}) but did not see this change: it reads another "
                f"config file than {path}. Reload the broker that reads it."), 1
    return f"The broker at {args.target} reloaded ({did}): it {what} now.", 0


def _give_token(token: str, token_file: str | None) -> None:
    """The token, once: into ``token_file`` (mode 0600, replaced whole), or printed as the last line."""
    if token_file is None:
        print("Its token, shown only now:")
        print(token)
        return
    from gpubroker.broker.certs import write_atomically

    write_atomically(Path(token_file), (token + "\n").encode(), 0o600)
    print(f"Its token is in {token_file} (mode 0600), shown nowhere else.")


def _cmd_tenant_list(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.json:  # (sizes in bytes; no token hashes)
        print(json.dumps({"tenants": [
            {"name": t.name, "memory": t.memory_quota, "weight": t.weight, "admin": t.admin,
             "device_memory": {str(d): q for d, q in sorted(t.device_memory.items())},
             "shared_memory": t.shared_quota()[0], "certificates_since": t.certificates_since}
            for t in cfg.tenants.values()]}, indent=2))
        return 0
    print(f"{'tenant':<24} {'memory':>10} {'weight':>6} {'admin':>5}  per device")
    for t in cfg.tenants.values():
        own = ", ".join(f"{d}: {format_size(q)}" for d, q in sorted(t.device_memory.items()))
        print(f"{t.name:<24} {format_size(t.memory_quota):>10} {t.weight:>6} {'yes' if t.admin else '':>5}  {own}")
    return 0


def _cmd_tenant_rotate(args: argparse.Namespace) -> int:
    token = mint_token()
    path = rotate_token_in_place(args.config, args.name, token.token_id, token.token_hash)
    audit.info("action=tenant-rotate-token tenant=%s config=%s by=%s", args.name, path, _who())
    return _reload_then_give_token(args, path, "changed", "takes the new token and refuses the old one", token.token,
                                   f"new token for tenant {args.name!r} in {path}.")


def _reload_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reload", action="store_true",
                        help="then reload the running broker at --target (an admin's token in GPUBROKER_TOKEN); "
                             "without it, the edit takes effect at the broker's next reload")
    parser.add_argument("--target", default=os.environ.get(TARGET_ENV) or DEFAULT_SOCKET,
                        help=f"the broker --reload reloads (default: the {TARGET_ENV} variable, else {DEFAULT_SOCKET})")


def _who() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:
        return f"uid {os.getuid()}"


def _cmd_tenant_remove(args: argparse.Namespace) -> int:
    path = remove_tenant_in_place(args.config, args.name)
    audit.info("action=tenant-remove tenant=%s config=%s by=%s", args.name, path, _who())
    reloaded, status = _reload_after_edit(args, path, "removed", "ends its sessions and refuses its token")
    print(f"removed tenant {args.name!r} from {path}. {reloaded}")
    return status


def _cmd_certs_init(args: argparse.Namespace) -> int:
    from gpubroker.broker.certs import default_sans, init_certs, tls_snippet

    sans = list(dict.fromkeys([*default_sans(), *(args.san or [])]))  # loopback and this host always work
    ca, server = init_certs(args.dir, sans, days=args.days, force=args.force)
    print(f"CA:     {ca.cert} (key {ca.key}, mode 0600; keep it off the broker host if you can)")
    print(f"server: {server.cert} (key {server.key}), SANs: {', '.join(sans)}")
    print("\nPaste into the broker's config:\n")
    print(tls_snippet(args.dir))
    print(f"\nClients get certificates with `gpubroker certs client NAME --dir {args.dir}`.")
    return 0


def _cmd_certs_client(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gpubroker.broker.certs import mint_client_cert

    out = mint_client_cert(args.dir, args.name, uri=args.uri, days=args.days, force=args.force)
    ca = Path(args.dir).resolve() / "ca.pem"
    print(f"client: {out.cert} (key {out.key}, mode 0600), CN={args.name}" + (f", URI={args.uri}" if args.uri else ""))
    if args.uri:
        print(f'\nMap it to a tenant in the broker\'s config:\n\n[tls.identities]\n"{args.uri}" = "{args.name}"')
    else:
        print(f"\nIt authenticates as tenant {args.name!r} (or map CN {args.name!r} in [tls.identities]).")
    print(f'\nClient: connect("HOST:PORT", tls=TlsOptions(ca_file="{ca}", cert_file="{out.cert}", '
          f'key_file="{out.key}"))')
    return 0


def _cmd_devices(args: argparse.Namespace) -> int:
    if args.target:
        from gpubroker.client import list_devices

        token = args.token or os.environ.get("GPUBROKER_TOKEN") or None
        devices = list_devices(args.target, token)
        kind = devices[0].backend if devices else "none"
        # (From the tenant's own ListDevices: an admin-only Status call would be refused, and audited, for most.)
        sandbox = (devices[0].sandbox if devices else None) or "unknown (the broker does not say)"
        heading = f"broker {args.target}, backend: {kind}, sandbox: {sandbox}"
    else:
        from gpubroker.broker.front import probe_devices

        cfg = load_config(args.config) if args.config else BrokerConfig()
        backend = args.backend or cfg.backend
        kind, devices = probe_devices(backend)
        sandbox = _local_sandbox(cfg, kind)
        heading = f"backend: {kind}, sandbox: {sandbox}"
    if args.json:
        print(json.dumps({"target": args.target, "backend": kind, "sandbox": sandbox,
                          "devices": [dataclasses.asdict(d) for d in devices]}, indent=2))
        return 0
    print(heading)
    for d in devices:
        cc = f"cc {d.compute_capability[0]}.{d.compute_capability[1]}" if d.compute_capability else d.opencl_version
        line = (f"  {d.id}: {d.name} ({d.vendor}), {d.total_memory / 2**30:.1f} GiB, "
                f"{d.multiprocessor_count} SMs/CUs at {d.clock_mhz} MHz, L2 {d.l2_cache_bytes / 2**20:.1f} MiB, {cc}")
        if d.health is not None:  # from a broker: whether it takes sessions, and this tenant's quota there
            line += f"; {d.health}" + (f" ({d.health_reason})" if d.health_reason else "")
            line += f"; quota {human_size(d.memory_quota or 0)}, used {human_size(d.memory_used or 0)}"
        print(line)
    return 0


def _local_sandbox(cfg: BrokerConfig, backend: str) -> str:
    """The sandbox a broker with this config would give its workers here (probed), or why it would refuse."""
    from gpubroker.broker.sandbox import SandboxUnavailable, WorkerSandbox

    # (No cgroups are set up for a look: that would move this process. "cgroup" needs a delegated cgroup.)
    sandbox = WorkerSandbox.from_config(cfg, backend, use_cgroups=False)
    try:
        sandbox.check()
    except SandboxUnavailable as exc:
        return f"UNAVAILABLE ({exc})"
    return sandbox.description if not cfg.sandbox else "namespaces+seccomp (+cgroup where delegated)"


def _cmd_demo(args: argparse.Namespace) -> int:
    from gpubroker.broker.demo import run_demo

    return run_demo(backend=args.backend or "auto")


# `gpubroker bench WHICH`: the module of the benchmarks' distribution (bench/ in the repository, `gpubroker-bench`,
# outside the gpubroker wheel) whose main() runs it.
_BENCHES = {"remote": "remote_vs_local", "fairness": "fairness", "multi": "multi_gpu", "fuzz": "fuzz", "soak": "soak",
            "cold-start": "cold_start", "arrays": "arrays", "array-api": "array_api",
            "torch": "torch_bench"}


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module(f"gpubroker_bench.{_BENCHES.get(args.which, 'remote_vs_local')}")
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("gpubroker_bench"):
            raise
        print("gpubroker: error: the benchmarks are a distribution of their own: install it from the repository's "
              "bench/ folder (`pip install ./bench`, or `./dev bench`, which does)", file=sys.stderr)
        return 2
    main: Callable[[list[str]], int] = module.main
    return main(args.rest)


def _cmd_loadtest(args: argparse.Namespace) -> int:
    from gpubroker.loadtest import LoadTestConfig, loadtest

    config = LoadTestConfig(tenants=args.tenants, duration=args.duration, mix=args.mix, backend=args.backend,
                            target=args.target, tokens_file=args.tokens, admin_tenant=args.admin_tenant,
                            tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                            device=args.device, max_ops=args.max_ops, long_ms=args.long_ms,
                            copy_bytes=parse_size(args.copy_size), out=args.out, png=args.png)
    return loadtest(config)[0]


def _cmd_relay(args: argparse.Namespace) -> int:
    from gpubroker.broker.relay import run_relay_command

    run_relay_command(args.listen, args.vsock_connect, args.max_connections, int(args.socket_mode, 8))
    return 0


def _metrics_address(value: str) -> str:
    if value:
        try:
            parse_host_port(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpubroker", description="A GPU API-remoting broker.")
    p.add_argument("--version", action="version", version=f"gpubroker {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the broker")
    s.add_argument("--config", required=True, help="TOML config (tenants, limits)")
    s.add_argument("--listen", action="append", help="unix:PATH or HOST:PORT (repeatable); overrides the config")
    s.add_argument("--backend", choices=["auto", "cuda", "opencl"], help="overrides the config")
    s.add_argument("--ready-file", help="write the bound addresses here (JSON) once serving")
    s.add_argument("--insecure", action="store_true",
                   help="allow plaintext TCP on non-loopback addresses (tokens travel in the clear)")
    s.add_argument("--no-sandbox", action="store_true",
                   help="run workers without their sandbox (tenants' code can then reach the broker and each other)")
    s.add_argument("--vsock-port", type=int, help="also accept VMs on this vsock port (0: off); overrides the config")
    s.add_argument("--metrics-listen", type=_metrics_address, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (empty: off); overrides the config")
    s.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON; overrides the config")
    s.set_defaults(fn=_cmd_serve)

    r = sub.add_parser("relay", help="in a VM: a local Unix socket relayed to the host's broker over vsock")
    r.add_argument("--listen", required=True, help="unix:PATH for local clients (e.g. unix:/run/gpubroker.sock)")
    r.add_argument("--vsock-connect", required=True, help="CID:PORT of the broker (CID 2 is the host)")
    r.add_argument("--max-connections", type=int, default=256, help="more are closed at once (default 256)")
    r.add_argument("--socket-mode", default="660", help="octal mode of the Unix socket (default 660)")
    r.set_defaults(fn=_cmd_relay)

    t = sub.add_parser("tenant", help="manage tenants in a config").add_subparsers(dest="tenant_cmd", required=True)
    ta = t.add_parser("add", help="add a tenant and print its token once")
    ta.add_argument("name")
    ta.add_argument("--config", required=True)
    ta.add_argument("--memory", default="8GiB", help="device memory quota (default 8GiB)")
    ta.add_argument("--weight", type=int, default=1, help="fair-share weight (default 1)")
    ta.add_argument("--shared-memory", metavar="SIZE",
                    help="host memory its sessions may share with its workers (default: equal to --memory)")
    ta.add_argument("--admin", action="store_true", help="may call the Admin service")
    ta.add_argument("--device-memory", action="append", metavar="DEVICE=SIZE",
                    help="a quota of its own on one device, e.g. 1=16GiB (repeatable; others get --memory)")
    ta.add_argument("--token-file", metavar="PATH", help="write the token there (mode 0600) instead of printing it: "
                    "a script's `| tail -n 1 > FILE` would hide a failed add")
    _reload_options(ta)
    ta.set_defaults(fn=_cmd_tenant_add)
    tl = t.add_parser("list", help="list tenants")
    tl.add_argument("--config", required=True)
    tl.add_argument("--json", action="store_true", help="the tenants as JSON (sizes in bytes) instead of a table")
    tl.set_defaults(fn=_cmd_tenant_list)
    tr = t.add_parser("remove", help="remove a tenant")
    tr.add_argument("name")
    tr.add_argument("--config", required=True)
    _reload_options(tr)
    tr.set_defaults(fn=_cmd_tenant_remove)
    tt = t.add_parser("rotate-token", help="replace a tenant's token and print the new one once")
    tt.add_argument("name")
    tt.add_argument("--config", required=True)
    tt.add_argument("--token-file", metavar="PATH", help="write the new token there (mode 0600) instead of printing it")
    _reload_options(tt)
    tt.set_defaults(fn=_cmd_tenant_rotate)

    cfg_sub = sub.add_parser("config", help="a config file").add_subparsers(dest="config_cmd", required=True)
    cc_check = cfg_sub.add_parser("check", help="read a config as `serve` would and check its listeners; exit 2 on a "
                                          "problem, naming the key")
    cc_check.add_argument("--config", required=True, help="the TOML config to check")
    cc_check.set_defaults(fn=_cmd_config_check)
    cc_keys = cfg_sub.add_parser("keys", help="every key a config may hold, with its type and what it does")
    cc_keys.add_argument("--table", choices=["broker", "tls", "tenants"], help="only this table's")
    cc_keys.set_defaults(fn=_cmd_config_keys)
    add_admin_parsers(sub)  # `gpubroker status`, `sessions`, `end-session`, `drain`, `reload`, `usage` (and admin)

    c = sub.add_parser("certs", help="mint a CA, server and client certificates for TLS on TCP listeners")
    cs = c.add_subparsers(dest="certs_cmd", required=True)
    ci = cs.add_parser("init", help="a CA and the broker's server certificate; prints the [tls] config")
    ci.add_argument("--dir", required=True, help="where to write ca.pem, ca.key, server.pem, server.key")
    ci.add_argument("--san", action="append", help="extra DNS name or IP for the server certificate (repeatable); "
                    "localhost, 127.0.0.1, ::1 and this host's name are always included")
    ci.add_argument("--days", type=int, default=825, help="server certificate validity (default 825)")
    ci.add_argument("--force", action="store_true",
                    help="replace an existing CA (the certificates it signed stop working)")
    ci.set_defaults(fn=_cmd_certs_init)
    cc = cs.add_parser("client", help="a client certificate signed by the CA in --dir (CN = NAME)")
    cc.add_argument("name")
    cc.add_argument("--dir", required=True, help="the directory `certs init` wrote; adds clients/NAME.pem and .key")
    cc.add_argument("--uri", help="a SAN URI (e.g. spiffe://example.org/team-a) to map in [tls.identities]")
    cc.add_argument("--days", type=int, default=365, help="validity (default 365)")
    cc.add_argument("--force", action="store_true", help="replace an existing certificate of this name")
    cc.set_defaults(fn=_cmd_certs_client)

    d = sub.add_parser("devices", help="list the devices the broker would serve (or, with --target, those a "
                       "running broker serves, with their health)")
    d.add_argument("--config")
    d.add_argument("--backend", choices=["auto", "cuda", "opencl"])
    d.add_argument("--target", default=os.environ.get(TARGET_ENV) or None,
                   help=f"ask a running broker (unix:PATH or HOST:PORT) instead of probing here (default: the "
                        f"{TARGET_ENV} variable)")
    d.add_argument("--token", help="a tenant's token for --target (prefer the GPUBROKER_TOKEN variable)")
    d.add_argument("--json", action="store_true", help="the devices as JSON (sizes in bytes) instead of lines")
    d.set_defaults(fn=_cmd_devices)

    m = sub.add_parser("demo", help="start an embedded broker and run two tenants' work against it")
    m.add_argument("--backend", choices=["auto", "cuda", "opencl"])
    m.set_defaults(fn=_cmd_demo)

    b = sub.add_parser("bench", help="benchmarks printing JSON: `remote` (gpubroker on every transport against "
                       "plain CuPy or pyopencl in one process: launch round trip, launch rate, copy bandwidth), "
                       "`fairness` (shares, Jain's index, light-tenant latency) or `multi` "
                       "(several devices: sessions on each, peer copies, fairness per device); `fuzz` (random and "
                       "hostile requests, --cases N), `soak` (session cycles: leaks of memory, fds, segments) and "
                       "`cold-start` (a tenant's first session, worker start included, sandboxed and not); "
                       "`array-api` (the Array API conformance suite against gpubroker.client.array, over a broker "
                       "or in process); `arrays` (an MLP training loop, an sklearn PCA, a row softmax, a stencil "
                       "and single operations on the Array API namespace through a broker, against the same code "
                       "on CuPy natively; --only picks parts); `torch` (an MLP, a "
                       "GPT-style decoder, ResNet-18 inference, launch-bound operators and client CPU per operator "
                       "on the torch device through a broker, against eager PyTorch natively)")
    b.add_argument("which", choices=["remote", "fairness", "multi", "fuzz", "soak", "cold-start", "array-api",
                                     "arrays", "torch"])
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options (--backend, --out, ...)")
    b.set_defaults(fn=_cmd_bench)

    lt = sub.add_parser("loadtest", help="many tenants with mixed workloads against a broker (embedded, or a "
                        "--target): live progress, a per-tenant table, JSON and a PNG; exit 1 on any error")
    lt.add_argument("--tenants", type=int, default=4, help="tenants, one process each (default 4, at most 64)")
    lt.add_argument("--duration", type=float, default=10.0, help="seconds of load (default 10, at most 3600)")
    lt.add_argument("--mix", default="copies,short,long,sync,async",
                    help="workloads given to tenants round-robin (a,b,c) or by weight (a=3,b=1): copies, short, "
                    "long, sync, async (default: all five)")
    lt.add_argument("--backend", choices=["auto", "cuda", "opencl"], default="auto", help="the embedded broker's")
    lt.add_argument("--target", help="a running broker instead: unix:PATH, a loopback HOST:PORT, or a remote "
                    "HOST:PORT with --tls-ca")
    lt.add_argument("--tls-ca", metavar="PEM", help="TLS to a HOST:PORT target: the CA of the broker's certificate")
    lt.add_argument("--tls-cert", metavar="PEM", help="with --tls-key: a client certificate (mTLS)")
    lt.add_argument("--tls-key", metavar="PEM", help="the client certificate's key")
    lt.add_argument("--tokens", help="with --target: JSON object of tenant name -> token, with the admin tenant's")
    lt.add_argument("--admin-tenant", default="admin", help="the admin tenant in --tokens, for usage (default admin)")
    lt.add_argument("--device", type=int, default=0, help="device index (default 0)")
    lt.add_argument("--max-ops", type=int, default=1_000_000, help="per tenant, at most (default 1000000)")
    lt.add_argument("--long-ms", type=float, default=5.0, help="the long kernel's calibrated length (default 5)")
    lt.add_argument("--copy-size", default="4MiB", help="bytes per copy of the copies workload (default 4MiB)")
    lt.add_argument("--out", default="loadtest.json", help="the JSON file (default ./loadtest.json)")
    lt.add_argument("--png", help="the plot (default: --out with .png)")
    lt.set_defaults(fn=_cmd_loadtest)
    return p


_RUNTIME_ERRORS = (Unavailable, DeadlineExceeded, Unauthenticated, PermissionDenied, ResourceExhausted, Internal,
                   Aborted, Cancelled, WorkerCrashed)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        return int(args.fn(args) or 0)
    except GpuBrokerError as exc:
        # 1: it failed where it ran (the broker unreachable, refusing the token, out of time or room, crashed),
        # which may pass on a retry; 2: what was asked cannot be done as asked (a bad argument, a bad or missing
        # config file, a name that exists or does not), as argparse's own usage errors.
        if json_logging() or getattr(args, "log_format", None) == "json":  # (`serve --log-format json`: its
            if not json_logging():  # stderr is JSON lines only, a config that failed to load included)
                configure_logging("json")
            logging.getLogger("gpubroker").error("%s", exc.message)
        else:
            print(f"gpubroker: error: {exc.message}", file=sys.stderr)
        return 1 if isinstance(exc, _RUNTIME_ERRORS) else 2
    except ModuleNotFoundError as exc:
        # A client-only install (`pip install gpubroker`) runs the client's commands; the broker's need its extra.
        missing = exc.name or ""
        if not any(missing == m or missing.startswith(m + ".") for m in BROKER_MODULES):
            raise
        print(f"gpubroker: error: `gpubroker {args.command}` needs the broker's dependencies ({exc.name} is not "
              f"installed): pip install 'gpubroker[broker]'", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
