#!/usr/bin/env bash
# The one-command GPU check: the CUDA-marked suite through real brokers, then the remote-vs-native benchmark.
# On the GPU machine, from the repo root, after ./dev gpu-wheels here:  bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/gpubroker-gpu-check}
mkdir -p "$OUTDIR"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpb-site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/gpb-site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/gpb-site/bin:$PATH  # the `gpubroker` command, which the docs' bash examples call
fi
export PYTHONUNBUFFERED=1
[ -f .whl/COMMIT ] && export GPUBROKER_COMMIT="$(cat .whl/COMMIT)"  # what the benchmarks' JSON names
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import cupy, grpc, google.protobuf as p; print("cupy", cupy.__version__, "grpc", grpc.__version__, "protobuf", p.__version__)'
"$PY" -m gpubroker.broker.cli devices --backend cuda
status=0
# TESTS=0, REMOTE=0, FAIRNESS=0, COLD=0, ARRAY_API=0, ARRAYS=0, TORCH=0 skip a part (to split the check across calls with a time limit).
if [ "${TESTS:-1}" = 1 ]; then
  # TEST_PATHS picks some of them (the whole list takes over 10 minutes on an H200: split it across calls).
  # -rfEs names each failure and skip in the summary; a test that outlives its pytest-timeout fails with its stack.
  # The torch device's OpInfo pass takes every sample here (the quick pass in CI takes one per OpInfo).
  export GPUBROKER_OPINFO_SAMPLES=${GPUBROKER_OPINFO_SAMPLES:-0}
  # A docs page whose examples outlive this fails with every Python stack of them (the reliability page's did not
  # finish on CUDA in session 29), within a call's 10 minutes.
  export GPUBROKER_PAGE_TIMEOUT=${GPUBROKER_PAGE_TIMEOUT:-300}
  # shellcheck disable=SC2086
  "$PY" -m pytest -p no:cacheprovider -o addopts="" -m cuda -q -rfEs --durations=15 \
    ${TEST_PATHS:-tests/security tests/integration tests/broker/backends/test_backend_contract.py \
    tests/broker/backends/test_cuda_backend.py tests/broker/backends/test_library.py \
    tests/client/array tests/client/torch tests/broker/backends/test_torch_session.py \
    tests/integration/test_torch_commands.py tests/docs/test_examples.py tests/docs/test_generated.py} 2>&1 |
    tee "$OUTDIR/gpu-tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "${REMOTE:-1}" = 1 ]; then
  "$PY" -m gpubroker.broker.cli bench remote --backend cuda --out "$OUTDIR/bench.json" || status=1
fi
if [ "${FAIRNESS:-1}" = 1 ]; then
  "$PY" -m gpubroker.broker.cli bench fairness --backend cuda --out "$OUTDIR/fairness.json" \
    --png "$OUTDIR/fairness.png" || status=1
fi
if [ "${COLD:-1}" = 1 ]; then
  "$PY" -m gpubroker.broker.cli bench cold-start --backend cuda --out "$OUTDIR/cold-start.json" || status=1
fi
# The array namespace: the standard's conformance suite over a broker (its folder: ARRAY_API_TESTS_DIR, else
# ../shared/array-api-tests; carry a copy to the GPU machine), then the MLP and PCA benchmark against CuPy.
if [ "${ARRAY_API:-1}" = 1 ]; then
  "$PY" -m gpubroker.broker.cli bench array-api --backend cuda --max-examples "${ARRAY_API_EXAMPLES:-20}" \
    --out "$OUTDIR/array-api.json" || status=1
fi
if [ "${ARRAYS:-1}" = 1 ]; then
  "$PY" -m gpubroker.broker.cli bench arrays --backend cuda --out "$OUTDIR/arrays.json" || status=1
fi
if [ "${TORCH:-1}" = 1 ]; then
  "$PY" -m gpubroker.broker.cli bench torch --backend cuda --out "$OUTDIR/torch.json" || status=1
fi
if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ]; then
  "$PY" -m gpubroker.broker.cli bench multi --backend cuda --out "$OUTDIR/multi.json" || status=1
fi
exit "$status"
