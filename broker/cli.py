"""`gpubroker`: serve, manage tenants, list devices, run the demo and the benchmark."""

from __future__ import annotations

import argparse
import logging
import sys

from gpubroker import __version__
from gpubroker.client import GpuBrokerError

from .auth import mint_token
from .config import TenantConfig, format_size, load_config, parse_size, save_config

__all__ = ["main"]


def _cmd_serve(args: argparse.Namespace) -> int:
    from .server import run_broker

    cfg = load_config(args.config)
    if args.listen:
        cfg.listen = args.listen
    if args.backend:
        cfg.backend = args.backend
    if not cfg.tenants:
        print(f"gpubroker: warning: {args.config} has no tenants; add one with `gpubroker tenant add`",
              file=sys.stderr)
    run_broker(cfg, ready_file=args.ready_file)
    return 0


def _cmd_tenant_add(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    token = mint_token()
    cfg.add_tenant(TenantConfig(name=args.name, token_id=token.token_id, token_hash=token.token_hash,
                                memory_quota=parse_size(args.memory), weight=args.weight))
    path = save_config(cfg, args.config)
    print(f"added tenant {args.name!r} to {path} (memory {format_size(parse_size(args.memory))}, "
          f"weight {args.weight}). Its token, shown only now:")
    print(token.token)
    return 0


def _cmd_tenant_list(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    print(f"{'tenant':<24} {'memory':>10} {'weight':>6}")
    for t in cfg.tenants.values():
        print(f"{t.name:<24} {format_size(t.memory_quota):>10} {t.weight:>6}")
    return 0


def _cmd_tenant_remove(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    cfg.remove_tenant(args.name)
    save_config(cfg, args.config)
    print(f"removed tenant {args.name!r}")
    return 0


def _cmd_devices(args: argparse.Namespace) -> int:
    from .server import probe_devices

    backend = args.backend or (load_config(args.config).backend if args.config else "auto")
    kind, devices = probe_devices(backend)
    print(f"backend: {kind}")
    for d in devices:
        cc = f"cc {d.compute_capability[0]}.{d.compute_capability[1]}" if d.compute_capability else d.opencl_version
        print(f"  {d.id}: {d.name} ({d.vendor}), {d.total_memory / 2**30:.1f} GiB, "
              f"{d.multiprocessor_count} SMs/CUs at {d.clock_mhz} MHz, L2 {d.l2_cache_bytes / 2**20:.1f} MiB, {cc}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(backend=args.backend or "auto")


def _cmd_bench(args: argparse.Namespace) -> int:
    from gpubroker.bench.remote_vs_local import main as bench_main

    return bench_main(["--backend", args.backend or "auto", *(["--out", args.out] if args.out else []),
                       *(["--quick"] if args.quick else [])])


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
    s.set_defaults(fn=_cmd_serve)

    t = sub.add_parser("tenant", help="manage tenants in a config").add_subparsers(dest="tenant_cmd", required=True)
    ta = t.add_parser("add", help="add a tenant and print its token once")
    ta.add_argument("name")
    ta.add_argument("--config", required=True)
    ta.add_argument("--memory", default="8GiB", help="device memory quota (default 8GiB)")
    ta.add_argument("--weight", type=int, default=1, help="fair-share weight (default 1)")
    ta.set_defaults(fn=_cmd_tenant_add)
    tl = t.add_parser("list", help="list tenants")
    tl.add_argument("--config", required=True)
    tl.set_defaults(fn=_cmd_tenant_list)
    tr = t.add_parser("remove", help="remove a tenant")
    tr.add_argument("name")
    tr.add_argument("--config", required=True)
    tr.set_defaults(fn=_cmd_tenant_remove)

    d = sub.add_parser("devices", help="list the devices the broker would serve")
    d.add_argument("--config")
    d.add_argument("--backend", choices=["auto", "cuda", "opencl"])
    d.set_defaults(fn=_cmd_devices)

    m = sub.add_parser("demo", help="start an embedded broker and run two tenants' work against it")
    m.add_argument("--backend", choices=["auto", "cuda", "opencl"])
    m.set_defaults(fn=_cmd_demo)

    b = sub.add_parser("bench", help="remote vs in-process: launch round trip, H2D/D2H bandwidth (JSON)")
    b.add_argument("--backend", choices=["auto", "cuda", "opencl"])
    b.add_argument("--out", help="also write the JSON here")
    b.add_argument("--quick", action="store_true", help="fewer iterations and smaller copies")
    b.set_defaults(fn=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        return int(args.fn(args) or 0)
    except GpuBrokerError as exc:
        print(f"gpubroker: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
