#!/usr/bin/env bash
# Regenerates the committed gRPC stubs; `--check` fails when the committed ones differ.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=src
if [ "${1:-}" = "--check" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
"$PY" -m grpc_tools.protoc -Isrc --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  src/gpubroker/v1/*.proto
if [ "${1:-}" = "--check" ]; then
  for f in "$out"/gpubroker/v1/*_pb2*.py*; do
    if ! diff -u "src/gpubroker/v1/$(basename "$f")" "$f"; then
      echo "generated stubs are stale: run scripts/gen_protos.sh" >&2
      exit 1
    fi
  done
  echo "generated stubs are up to date"
fi
