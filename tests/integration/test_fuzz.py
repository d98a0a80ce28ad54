"""Fuzzing: random and hostile requests on every RPC, on the framed link (Unix socket and TCP with TLS) and on the
broker's other raw local sockets.

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
from gpubroker_bench.fuzz import (
    GrpcFuzzer,
    LinkFuzzer,
    LinkTarget,
    LinkVictims,
    RawFuzzer,
    fuzz_limits,
    link_fuzzer,
    start_fuzz_broker,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpubroker.broker.launcher import BrokerProcess

EXAMPLES = int(os.environ.get("GPUBROKER_FUZZ_EXAMPLES", "100"))
# Derandomized: CI runs the same cases every time (a failure reproduces); the bench run explores at random.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAW = settings(FUZZ, max_examples=EXAMPLES)
LINK = settings(FUZZ, max_examples=EXAMPLES * 2)  # the framed link's cases are cheap, and it is the new surface


@pytest.fixture(scope="module")
def broker_and_links(backend: str) -> Iterator[tuple[BrokerProcess, list[LinkTarget]]]:
    with start_fuzz_broker(backend) as started:
        yield started


@pytest.fixture(scope="module")
def fuzz_broker(broker_and_links: tuple[BrokerProcess, list[LinkTarget]]) -> BrokerProcess:
    return broker_and_links[0]


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


@pytest.fixture(scope="module")
def link(fuzz_broker: BrokerProcess, fuzzer: GrpcFuzzer, backend: str) -> Iterator[tuple[LinkFuzzer, LinkVictims]]:
    with link_fuzzer(fuzz_broker, fuzzer.observe, backend) as pair:
        yield pair


@FUZZ
@given(data=st.data())
def test_every_rpc_under_random_invalid_and_hostile_requests(fuzzer: GrpcFuzzer, data: Any) -> None:
    fuzzer.run_case(data)


@LINK
@given(data=st.data())
def test_framed_link_under_hostile_batches_and_malformed_frames(
        broker_and_links: tuple[BrokerProcess, list[LinkTarget]], link: tuple[LinkFuzzer, LinkVictims],
        data: Any) -> None:
    """Raw Batch frames on the Unix link and the TCP link (TLS): every frame answered by an Ack or the link closed,
    and after each case a fresh link on the session frees what the case left and reads back what it writes."""
    targets = broker_and_links[1]
    link[0].case(data.draw, data.draw(st.sampled_from(targets), label="where"))


def test_after_the_link_fuzz_the_session_holds_nothing_and_the_victims_are_intact(
        fuzzer: GrpcFuzzer, link: tuple[LinkFuzzer, LinkVictims]) -> None:
    links, victims = link
    assert links.cases and links.acks  # (it ran above, in this module, and reached the worker)
    assert links.reads_checked  # and read back bytes it knew
    fuzzer.check_raw_session(links.session)
    victims.check()  # another tenant's and another session's buffers, whose handles the cases named


@RAW
@given(data=st.data())
def test_segment_connections_under_garbage_frames_and_hostile_descriptors(raw: RawFuzzer, fuzzer: GrpcFuzzer,
                                                                          data: Any) -> None:
    raw.segments_case(data.draw)
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
        # (which ones, in a derandomized run, depends on what hypothesis draws: most of them, not each. Its draws
        # lean to the first handle of a pool, often another kind's, so a call needing two live handles of the session
        # seldom succeeds: with these seeds PoCL reached 6 of the 8, CUDA 5, a CopyShared neither.)
        assert len(reached) >= 5, sorted((k, v) for k, v in fuzzer.statuses.items() if k.startswith(paths))
