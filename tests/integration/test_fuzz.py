"""Fuzzing: random and hostile requests on every RPC and on the broker's raw local sockets.

A short run here (one broker for the module); ``gpubroker bench fuzz --cases 100000`` runs the long one. Each case
checks that every answer is OK or a documented status, that calls naming sessions or handles the caller does not
own fail, that bytes read back are those written, and that the broker's memory and handle accounting equals the
model's (see bench/fuzz). ``GPUBROKER_FUZZ_EXAMPLES`` scales the number of cases.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpubroker.bench.fuzz import FUZZ_SETTINGS, FUZZ_TENANTS, GrpcFuzzer, RawFuzzer, fuzz_limits
from gpubroker.broker.launcher import BrokerProcess

EXAMPLES = int(os.environ.get("GPUBROKER_FUZZ_EXAMPLES", "250"))
# Derandomized: CI runs the same cases every time (a failure reproduces); the bench run explores at random.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAW = settings(FUZZ, max_examples=EXAMPLES)


@pytest.fixture(scope="module")
def fuzz_broker(backend: str) -> Iterator[BrokerProcess]:
    with BrokerProcess(FUZZ_TENANTS, backend=backend, settings=FUZZ_SETTINGS) as broker:
        yield broker


@pytest.fixture(scope="module")
def fuzzer(fuzz_broker: BrokerProcess) -> Iterator[GrpcFuzzer]:
    tokens = {t: fuzz_broker.tokens[t] for t in ("alice", "bob", "eve")}
    fuzz = GrpcFuzzer(fuzz_broker.target, tokens, fuzz_broker.tokens["root"], fuzz_limits(), max_steps=6)
    yield fuzz
    fuzz.close()


@pytest.fixture(scope="module")
def raw(fuzz_broker: BrokerProcess, fuzzer: GrpcFuzzer) -> RawFuzzer:
    token = fuzz_broker.tokens["mallory"]
    return RawFuzzer(fuzz_broker.target, token, fuzzer.open_session(token), fuzzer.observe)


@FUZZ
@given(data=st.data())
def test_every_rpc_under_random_invalid_and_hostile_requests(fuzzer: GrpcFuzzer, data: Any) -> None:
    fuzzer.run_case(data)


@RAW
@given(data=st.data())
def test_fast_path_socket_under_garbage_and_malformed_frames(raw: RawFuzzer, data: Any) -> None:
    """Before and after a valid hello, on the front's connection and on a direct link to the worker."""
    raw.fast_case(data.draw)


@RAW
@given(data=st.data())
def test_shared_memory_socket_under_garbage_frames_and_hostile_descriptors(raw: RawFuzzer, fuzzer: GrpcFuzzer,
                                                                            data: Any) -> None:
    raw.shm_case(data.draw)
    fuzzer.check_raw_session(raw.session)


@settings(RAW, max_examples=max(5, EXAMPLES // 10))
@given(data=st.data())
def test_grpc_socket_under_random_bytes(raw: RawFuzzer, data: Any) -> None:
    raw.grpc_case(data.draw)


def test_the_broker_survived_with_exact_accounting_and_nothing_unexpected_logged(
        fuzz_broker: BrokerProcess, fuzzer: GrpcFuzzer, raw: RawFuzzer) -> None:
    assert fuzz_broker.process is not None and fuzz_broker.process.poll() is None
    assert fuzzer.broker_alive()
    fuzzer.check_accounting()
    fuzzer.check_raw_session(raw.session)
    log = fuzz_broker.log_tail(1 << 30)
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:4000]
    if fuzzer.cases >= 100:  # (the cases above ran in this session) they reached the data paths, not only errors
        paths = ("CopyHostToDevice", "CopyDeviceToHost", "CopyDeviceToDevice", "Memset", "LaunchKernel", "CopyShared",
                 "Commands", "Free")
        reached = [p for p in paths if fuzzer.statuses[f"{p} OK"]]
        # (which ones, in a derandomized run, depends on what hypothesis draws: most of them, not each)
        assert len(reached) >= 6, {k: v for k, v in fuzzer.statuses.items() if k.startswith(paths)}
