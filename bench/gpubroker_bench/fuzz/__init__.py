"""Fuzzing the broker: its gRPC API (random and invalid fields, hostile sequences), the framed link straight to a
worker (raw Batch frames on the Unix socket and on TCP with TLS) and its other raw local sockets.

``GrpcFuzzer``, ``LinkFuzzer`` and ``RawFuzzer`` run hypothesis-drawn cases against a running broker
(``start_fuzz_broker``); tests/integration/test_fuzz.py runs a short mix in CI and ``gpubroker bench fuzz --cases N``
a long one (see ``main``).
"""

from gpubroker_bench.fuzz._bench import FUZZ_SETTINGS, FUZZ_TENANTS, fuzz_limits, link_fuzzer, main, start_fuzz_broker
from gpubroker_bench.fuzz._grpc import FuzzFailure, GrpcFuzzer
from gpubroker_bench.fuzz._link import LinkFuzzer, LinkTarget, LinkVictims
from gpubroker_bench.fuzz._model import ALLOWED_CODES
from gpubroker_bench.fuzz._raw import RawFuzzer

__all__ = ["ALLOWED_CODES", "FUZZ_SETTINGS", "FUZZ_TENANTS", "FuzzFailure", "GrpcFuzzer", "LinkFuzzer",
           "LinkTarget", "LinkVictims", "RawFuzzer", "fuzz_limits", "link_fuzzer", "main", "start_fuzz_broker"]
