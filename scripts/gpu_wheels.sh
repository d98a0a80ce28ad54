#!/usr/bin/env bash
# Build .whl/ for the GPU machine, which has CuPy, grpcio 1.84, numpy, msgpack and uvloop but may lack
# the rest: gpubroker itself, a protobuf new enough for the committed stubs, and pytest's timeout plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
"$PY" -m pip wheel -q --no-deps -w .whl .
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "protobuf==$("$PY" -c 'import google.protobuf as p; print(p.__version__)')"
"$PY" -m pip download -q --no-deps -d .whl pytest-timeout
ls -l .whl
