#!/usr/bin/env bash
# Build .whl/ for the GPU machine. Its image has CuPy, grpcio 1.84, protobuf 7.36, numpy, msgpack, uvloop,
# pytest and pytest-timeout; it lacks gpubroker itself and the pure-Python wheels fetched below.
# gpubroker is built from a copy, so the checkout gets no build/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$PWD/.venv/bin/python}
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$src"
rm -rf .whl && mkdir -p .whl
(cd "$src" && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OLDPWD/.whl" . ./bench)
# Pure-Python dependencies the GPU image lacks (it has grpcio 1.84, so the grpc add-ons are pinned to match);
# nvidia-ml-py (pynvml) lets the front watch each worker's device memory and the GPUs' Xids through NVML.
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl \
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 grpcio-status==1.84.0 'googleapis-common-protos>=1.63' 'prometheus-client>=0.20' 'tomlkit>=0.13' 'pyseccomp>=0.1.2' \
  'nvidia-ml-py>=12' 'array-api-compat>=1.11' 'array-api-strict>=2.4' 'pytest-json-report>=1.5' pytest-metadata \
  'expecttest>=0.2'
# (The image has torch 2.11, scikit-learn, scipy and einops; the array namespace's tests and the conformance suite
# need the rest: array-api-compat, array-api-strict, pytest-json-report and ndindex (its hypothesis was 6.168 in
# 2026-11); the torch device's OpInfo tests need expecttest.)
# msgspec (the wire's msgpack and the config's schema), lz4 (copies on slow links) and cryptography (TLS test certificates; cffi under it) are compiled: fetched for the GPU image's CPython 3.12 on x86_64, whatever runs here.
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl --implementation cp --python-version 3.12 \
  --abi cp312 --abi abi3 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 'msgspec>=0.19' 'lz4>=4' 'cryptography>=42' 'cffi>=1.14' \
  pycparser 'ndindex>=1.8'
# The commit these wheels hold, for the benchmarks' JSON (the GPU machine has no git history).
{ git rev-parse HEAD | tr -d '\n'; git diff --quiet HEAD -- . || printf '+dirty'; echo; } > .whl/COMMIT
ls -l .whl
