"""The operator's commands over the Admin service: `gpubroker status | sessions | end-session | drain | reload |
usage`, each also under `gpubroker admin ...`. Every one needs an admin tenant's token (`--token` or, better, the
GPUBROKER_TOKEN variable) and the broker's address (`--target`, or the GPUBROKER_TARGET variable); `--json` prints
what the broker answered as JSON (the Admin service's messages, protobuf's JSON mapping) instead of tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from gpubroker.broker.config import DEFAULT_SOCKET, format_size

__all__ = ["TARGET_ENV", "add_admin_parsers", "human_size", "run_admin", "table"]

# The commands, each at the top level and under `gpubroker admin`.
_COMMANDS = ("status", "sessions", "end-session", "reload", "drain", "undrain", "usage")

# The broker's address when --target is not given, as the quickstart exports it (beside GPUBROKER_TOKEN).
TARGET_ENV = "GPUBROKER_TARGET"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Iterable[int] = ()) -> str:
    """Rows as aligned columns under their headers; columns numbered in ``right`` align right."""
    cells = [[str(h) for h in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    right = set(right)
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def human_size(n: int) -> str:
    """Bytes for a table: in binary units as the config writes them, one decimal where not whole (``4.0KiB``,
    ``12.1KiB``, ``3GiB``), one token so that columns split on whitespace; --json keeps the bytes."""
    if n % 1024 == 0 and n:
        return format_size(n)
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def _sessions_table(sessions: Sequence[Any]) -> str:
    if not sessions:
        return "(no sessions)"
    return table(["session", "tenant", "dev", "idle s", "memory", "worker", "lost"],
                 [[s.session, s.tenant, s.device, f"{s.idle_seconds:.1f}", human_size(s.memory_used),
                   s.worker_pid or "", s.lost] for s in sessions], right=(2, 3, 4, 5))


def _usage_table(resp: Any) -> str:
    if not resp.tenants:
        return "(no tenant has used a device yet)"
    return table(["tenant", "dev", "weight", "device s", "share", "queued", "inflight", "wait p50 ms", "p99 ms",
                  "memory used", "quota", "sessions", "shared host", "limit"],
                 [[u.tenant, u.device, f"{u.weight:g}", f"{u.device_seconds:.3f}", f"{u.share:.1%}", u.queued,
                   u.inflight, f"{u.wait_p50_ms:.2f}", f"{u.wait_p99_ms:.2f}", human_size(u.memory_used),
                   human_size(u.memory_quota), u.sessions, human_size(u.shared_bytes),
                   human_size(u.shared_bytes_limit)] for u in resp.tenants], right=range(1, 14))


def _print_status(target: str, status: Any, sessions: Sequence[Any], usage: Any, window: float) -> None:
    state = status.health + (", draining" if status.draining else "")
    if status.HasField("drain_seconds_left"):
        state += f" (sessions left are ended in {status.drain_seconds_left:.0f} s)"
    print(f"gpubroker {status.version} at {target}: {state}; up {_duration(status.uptime_seconds)}")
    print(f"sandbox: {status.sandbox or 'unknown'}")
    print("\ndevices")
    print(table(["dev", "name", "backend", "memory", "health", "sessions", "memory used", "worker failures",
                 "reason"],
                [[d.device, d.name, d.backend, f"{d.total_memory / 2**30:.1f} GiB", d.health, d.sessions,
                  human_size(d.memory_used), d.recent_worker_failures, d.reason] for d in status.devices],
                right=(0, 3, 5, 6, 7)))
    print("\ntenants")
    print(table(["tenant", "weight", "quota", "admin", "sessions", "memory used"],
                [[t.tenant, t.weight, format_size(t.memory_quota), "yes" if t.admin else "no", t.sessions,
                  human_size(t.memory_used)] for t in status.tenants], right=(1, 2, 4, 5)))
    print("\nsessions")
    print(_sessions_table(sessions))
    print(f"\nusage (share over the last {window:g} s; fair scheduling {'on' if usage.fair_scheduling else 'off'}, "
          f"quantum {usage.quantum_ms:g} ms)")
    print(_usage_table(usage))


# The window `status` shows the usage share over.
_STATUS_WINDOW = 10.0


def run_admin(args: argparse.Namespace) -> int:
    from gpubroker.client import AdminClient

    token = args.token or os.environ.get("GPUBROKER_TOKEN", "")
    if not token:
        print("gpubroker: error: an admin token is needed (--token or GPUBROKER_TOKEN)", file=sys.stderr)
        return 2
    with AdminClient(args.target, token) as admin:
        answer = _ask(admin, args)
    if args.json:
        print(json.dumps(_as_json(args, answer), indent=2))
    else:
        _print_answer(args, answer)
    return 0


def _ask(admin: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The broker's answers to the command (Admin service messages, or lists of them), by name."""
    command = args.admin_cmd
    if command == "status":
        return {"status": admin.status(), "sessions": admin.list_sessions(), "usage": admin.usage(_STATUS_WINDOW)}
    if command == "sessions":
        return {"sessions": admin.list_sessions(args.tenant or "")}
    if command == "end-session":
        return {"ended": admin.end_session(args.session)}
    if command == "reload":
        return {"reload": admin.reload()}
    if command == "usage":
        return {"usage": admin.usage(args.window)}
    if command == "undrain":
        return {"undrain": admin.undrain()}
    return {"drain": admin.drain(args.grace)}


def _as_json(args: argparse.Namespace, answer: dict[str, Any]) -> dict[str, Any]:
    """The answers in protobuf's JSON mapping: status and sessions by name, a command's one message as itself."""
    from google.protobuf.json_format import MessageToDict

    def plain(message: Any) -> dict[str, Any]:
        found: dict[str, Any] = MessageToDict(message, preserving_proto_field_name=True,
                                              always_print_fields_with_no_presence=True)
        return found

    command = args.admin_cmd
    if command in ("status", "sessions"):
        shaped = {name: [plain(m) for m in value] if isinstance(value, list) else plain(value)
                  for name, value in answer.items()}
        return {"target": args.target, **shaped} if command == "status" else shaped
    (one,) = answer.values()
    return {"session": args.session, **plain(one)} if command == "end-session" else plain(one)


def _print_answer(args: argparse.Namespace, answer: dict[str, Any]) -> None:
    command = args.admin_cmd
    if command == "status":
        _print_status(args.target, answer["status"], answer["sessions"], answer["usage"], _STATUS_WINDOW)
    elif command == "sessions":
        print(_sessions_table(answer["sessions"]))
    elif command == "end-session":
        ended = answer["ended"]
        print(f"ended session {args.session} of tenant {ended.tenant}; freed {ended.memory_freed} bytes")
    elif command == "reload":
        r = answer["reload"]
        print(f"reloaded: added {list(r.added)}, removed {list(r.removed)}, changed {list(r.changed)}, "
              f"{r.sessions_ended} sessions ended")
    elif command == "usage":
        usage = answer["usage"]
        print(f"fair scheduling {'on' if usage.fair_scheduling else 'off'}, quantum {usage.quantum_ms:g} ms; "
              f"share over the last {args.window:g} s")
        print(_usage_table(usage))
    elif command == "undrain":
        undrained = answer["undrain"]
        print(("drain ended: new sessions are taken again" if undrained.was_draining
               else "the broker was not draining") + f"; {undrained.sessions_running} sessions running")
    else:
        drained = answer["drain"]
        when = (f"; those still running are ended in {drained.seconds_left:.0f} s"
                if drained.HasField("seconds_left") else "; running sessions go on until they close")
        print(f"draining: new sessions are refused (health NOT_SERVING){when}. "
              f"{drained.sessions_running} sessions still running:")
        print(_sessions_table(drained.sessions))


def _target_options(defaults: bool = True) -> argparse.ArgumentParser:
    """--target and --token; without ``defaults`` (a subcommand's copy) they do not override the group's."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--target", default=os.environ.get(TARGET_ENV) or DEFAULT_SOCKET if defaults
                         else argparse.SUPPRESS,
                         help=f"broker address (default: the {TARGET_ENV} variable, else {DEFAULT_SOCKET})")
    options.add_argument("--token", default=None if defaults else argparse.SUPPRESS,
                         help="an admin tenant's token (prefer the GPUBROKER_TOKEN variable)")
    options.add_argument("--json", action="store_true", default=False if defaults else argparse.SUPPRESS,
                         help="print the broker's answer as JSON instead of tables")
    return options


def _add_commands(sub: Any, parents: list[argparse.ArgumentParser], names: Sequence[str]) -> None:
    helps = {
        "status": "devices with their health, tenants, sessions and usage, as tables",
        "sessions": "list sessions",
        "end-session": "end a session and free its memory",
        "reload": "re-read tenants from the config file",
        "drain": "refuse new sessions (health NOT_SERVING); running ones go on",
        "undrain": "end a drain: take new sessions again",
        "usage": "per tenant and device: device time, share, queue, waits, memory, shared host memory",
    }
    for name in names:
        p = sub.add_parser(name, help=helps[name], parents=parents)
        p.set_defaults(admin_cmd=name, fn=run_admin)
        if name == "sessions":
            p.add_argument("--tenant", help="only this tenant's")
        elif name == "end-session":
            p.add_argument("session")
        elif name == "drain":
            p.add_argument("--grace", type=float, metavar="S",
                           help="end the sessions still running after S seconds (default: let them run)")
        elif name == "usage":
            p.add_argument("--window", type=float, default=10.0, help="seconds over which to compute shares")


def add_admin_parsers(sub: Any) -> None:
    """`gpubroker admin ...` and the same commands at the top level."""
    options = _target_options()
    a = sub.add_parser("admin", help="admin calls on a running broker (token: --token or GPUBROKER_TOKEN)",
                       parents=[options])
    _add_commands(a.add_subparsers(dest="admin_cmd", required=True), [_target_options(defaults=False)], _COMMANDS)
    _add_commands(sub, [options], _COMMANDS)
