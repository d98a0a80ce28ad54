#!/usr/bin/env bash
# The package maps gpubroker.client to client/ and so on (pyproject.toml's package-dir), but mypy and the docs' API
# reference (griffe) find modules by their directories: lay that layout as links under build/pkg (mypy's
# mypy_path, mkdocs.yml's handler paths). Errors and source links keep the repository's own paths.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/pkg/gpubroker
mkdir -p "$tree"
ln -sfn ../../../protos/gpubroker/__init__.py "$tree/__init__.py"
ln -sfn ../../../protos/gpubroker/v1 "$tree/v1"
for pkg in client broker bench; do ln -sfn "../../../$pkg" "$tree/$pkg"; done
