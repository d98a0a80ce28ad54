"""`gpubroker bench fuzz`: a long fuzzing run against a fresh broker, reported as JSON.

Run: ``gpubroker bench fuzz --cases 100000 [--backend auto|cuda|opencl] [--max-steps 4] [--seed N] [--out fuzz.json]``.
Cases are gRPC cases (``GrpcFuzzer``) and, a share of them, raw-socket cases: the framed link on the Unix socket
and on the TCP link with TLS (``LinkFuzzer``), segment connections on the link socket and the gRPC socket
(``RawFuzzer``).
It stops at the first broken promise and reports it; otherwise it reports every status seen, whether the broker
is still up and whether its accounting is still exact.
"""

from __future__ import annotations

import argparse
import itertools
import json
import ssl
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from gpubroker.broker.certs import init_certs
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.wire.addresses import unix_path
from gpubroker_bench._net import free_port
from gpubroker_bench.fuzz._link import LinkFuzzer, LinkTarget, LinkVictims, open_link_session

__all__ = ["FUZZ_SETTINGS", "FUZZ_TENANTS", "fuzz_limits", "link_fuzzer", "main", "run_fuzz",
           "start_fuzz_broker"]

# "root" administers, alice, bob and eve are fuzzed through gRPC, mallory through the raw sockets and the framed
# link; trent is the link fuzz's victim (its buffer's handle is named, its data must survive, its session work).
FUZZ_TENANTS = [TenantSpec("root", memory_quota=1 << 20, admin=True), TenantSpec("alice", memory_quota=8 << 20),
                TenantSpec("bob", memory_quota=2 << 20), TenantSpec("eve", memory_quota=256 << 10),
                TenantSpec("mallory", memory_quota=4 << 20), TenantSpec("trent", memory_quota=1 << 20)]
# Small limits, so that fuzzed requests reach them: chunking, message and module sizes, handles, sessions, streams.
FUZZ_SETTINGS: dict[str, object] = {
    "lease_seconds": 600.0, "chunk_bytes": 64 << 10, "max_message_bytes": 1 << 20, "max_module_bytes": 64 << 10,
    "max_handles_per_session": 64, "max_sessions_per_tenant": 4, "max_streams_per_session": 4,
    "max_shared_bytes_per_session": 1 << 20, "worker_idle_seconds": 3600.0,
    "device_failure_threshold": 0,  # a tenant crashing its own worker must not take the device out of service
    # Wrong tokens are part of the mix: the failure delay (tested in tests/security/test_auth_cost.py) would make
    # each later case wait up to a second; a short cap keeps it in play without setting the pace.
    "auth_failure_delay_max_seconds": 0.01}
_GRPC_TENANTS = ("alice", "bob", "eve")


@contextmanager
def start_fuzz_broker(backend: str) -> Iterator[tuple[BrokerProcess, list[LinkTarget]]]:
    """A broker with the fuzz's tenants and limits, a TCP link with TLS, and the two places a link is opened:
    its Unix socket and its TCP port."""
    with tempfile.TemporaryDirectory(prefix="gpb-fuzz-") as certs:
        _, server = init_certs(certs)
        port = free_port()
        settings = {**FUZZ_SETTINGS, "tls": TlsConfig(cert_file=str(server.cert), key_file=str(server.key)),
                    "link_listen": f"127.0.0.1:{port}"}
        with BrokerProcess(FUZZ_TENANTS, backend=backend, settings=settings, tcp=["127.0.0.1:0"]) as broker:
            tls = ssl.create_default_context(cafile=str(Path(certs) / "ca.pem"))
            yield broker, [LinkTarget("unix", unix_path=f"{unix_path(broker.target)}.fast"),
                           LinkTarget("tcp", address=("127.0.0.1", port), tls=tls)]


@contextmanager
def link_fuzzer(broker: BrokerProcess, observe: Callable[[str, str, str], Any],
                backend: str) -> Iterator[tuple[LinkFuzzer, LinkVictims]]:
    """mallory's link session with the fuzz kernels, and the victims whose handles it names."""
    gpu, kernels = open_link_session(broker.target, broker.tokens["mallory"], backend)
    victims = LinkVictims(broker.target, broker.tokens["trent"], broker.tokens["mallory"])
    try:
        yield LinkFuzzer(broker.tokens["mallory"], gpu.session, kernels, victims.handles, observe), victims
    finally:
        victims.close()
        gpu.close()


def fuzz_limits() -> dict[str, Any]:
    return {"quotas": {t.name: t.memory_quota for t in FUZZ_TENANTS}, "chunk_bytes": FUZZ_SETTINGS["chunk_bytes"],
            "max_module_bytes": FUZZ_SETTINGS["max_module_bytes"],
            "max_shared_bytes": FUZZ_SETTINGS["max_shared_bytes_per_session"]}


def run_fuzz(broker: BrokerProcess, targets: list[LinkTarget], cases: int, max_steps: int, raw_share: float,
             seed: int | None, compile_odds: int = 8, progress: bool = True) -> dict[str, Any]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed
    from hypothesis import strategies as st
    from hypothesis.errors import Flaky, FlakyStrategyDefinition

    from gpubroker_bench.fuzz._grpc import GrpcFuzzer
    from gpubroker_bench.fuzz._raw import RawFuzzer

    fuzzer = GrpcFuzzer(broker.target, {t: broker.tokens[t] for t in _GRPC_TENANTS}, broker.tokens["root"],
                        fuzz_limits(), max_steps=max_steps, compile_odds=compile_odds)
    raw = RawFuzzer(broker.target, broker.tokens["mallory"], fuzzer.open_session(broker.tokens["mallory"]),
                    fuzzer.observe)
    stack = ExitStack()
    link, victims = stack.enter_context(link_fuzzer(broker, fuzzer.observe, fuzzer.backend))
    kinds: Counter[str] = Counter()
    started = time.monotonic()
    raw_weight = max(0, min(100, round(raw_share * 100)))
    by_name = {t.name: t for t in targets}
    choices = ["grpc"] * (100 - raw_weight) + [*(f"link_{t}" for t in by_name), "segments", "grpc_socket"] * raw_weight

    def one_case(data: Any) -> None:
        kind = data.draw(st.sampled_from(choices), label="kind")
        if kind == "grpc":
            fuzzer.run_case(data)
        elif kind.startswith("link_"):
            link.case(data.draw, by_name[kind[len("link_"):]])
            if kinds[kind] % 50 == 0:
                fuzzer.check_raw_session(link.session)
                victims.check()
        else:
            getattr(raw, f"{'grpc' if kind == 'grpc_socket' else kind}_case")(data.draw)
            if kinds[kind] % 50 == 0:
                fuzzer.check_raw_session(raw.session)
        kinds[kind] += 1
        total = sum(kinds.values())
        if progress and total % 1000 == 0:
            print(f"fuzz: {total} cases, {fuzzer.steps} calls, {time.monotonic() - started:.0f} s", file=sys.stderr,
                  flush=True)

    failure = None
    restarts = 0
    # In rounds of at most 1,000 cases: a round that hypothesis ends for nondeterminism of its own making (a
    # worker's crash timing can change what a replayed case draws) is counted and the next round goes on.
    for round_number in itertools.count():
        left = cases - sum(kinds.values())
        if left <= 0:
            break
        run = settings(max_examples=min(left, 1000), deadline=None, database=None, phases=[Phase.generate],
                       suppress_health_check=list(HealthCheck), print_blob=True)(given(data=st.data())(one_case))
        if seed is not None:
            run = with_seed(seed + round_number)(run)
        try:
            run()
        except (Flaky, FlakyStrategyDefinition):
            restarts += 1
            if restarts > 10:
                failure = "hypothesis kept finding the cases nondeterministic"
                break
        except BaseException as exc:  # report it with the figures so far (KeyboardInterrupt included)
            failure = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-4000:]
            break
    duration = time.monotonic() - started
    alive = broker.process is not None and broker.process.poll() is None and fuzzer.broker_alive()
    exact = False
    if alive:
        try:
            fuzzer.check_accounting()
            fuzzer.check_raw_session(raw.session)
            fuzzer.check_raw_session(link.session)
            victims.check()
            exact = True
        except AssertionError as exc:
            failure = failure or str(exc)
    stack.close()
    by_code: Counter[str] = Counter()
    for key, count in fuzzer.statuses.items():
        by_code[key.rsplit(" ", 1)[1]] += count
    log = broker.log_tail(1 << 30)
    fuzzer.close()
    total = sum(kinds.values())
    return {"cases": total, "cases_by_kind": dict(kinds), "hypothesis_restarts": restarts, "calls": fuzzer.steps,
            "duration_s": round(duration, 1),
            "cases_per_s": round(total / duration, 1) if duration else 0.0, "statuses": dict(by_code.most_common()),
            "statuses_by_call": dict(sorted(fuzzer.statuses.items())), "broker_alive": alive,
            "accounting_exact": exact, "failure": failure, "broker_tracebacks": log.count("Traceback"),
            "link": {"cases": link.cases, "acks": link.acks, "hellos_closed": link.closed},
            "worker_deaths": sum(1 for line in log.splitlines()
                                 if " ERROR " in line and "the worker process for tenant" in line)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker bench fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "opencl"])
    parser.add_argument("--max-steps", type=int, default=4, help="calls per gRPC case, at most (default 4)")
    parser.add_argument("--raw-share", type=float, default=0.1, help="share of raw-socket cases (default 0.1)")
    parser.add_argument("--compile-odds", type=int, default=8,
                        help="one gRPC case in this many builds the fuzz kernels first (default 8)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    with start_fuzz_broker(args.backend) as (broker, targets):
        result = run_fuzz(broker, targets, args.cases, args.max_steps, args.raw_share, args.seed, args.compile_odds)
        result.update(backend=args.backend, max_steps=args.max_steps, compile_odds=args.compile_odds, seed=args.seed)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["failure"] is None and result["broker_alive"] and result["accounting_exact"] else 1
