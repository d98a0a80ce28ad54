#!/bin/sh
# The Array API conformance suite (../shared/array-api-tests) against gpubroker.client.array: a wrapper of
# `gpubroker bench array-api` (bench/gpubroker_bench/array_api.py), which says the options. Examples:
#   scripts/array_api_tests.sh --mode inprocess --max-examples 20
#   scripts/array_api_tests.sh --backend cuda --max-examples 50 --out /tmp/aat.json -- array_api_tests/test_linalg.py
exec "${PYTHON:-python3}" -m gpubroker_bench.array_api "$@"
