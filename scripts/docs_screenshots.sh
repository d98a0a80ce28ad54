#!/usr/bin/env bash
# Screenshots of the docs site for a person to look at (layout, legibility): the home page, the API reference and
# the operator guide, in headless Chromium, light theme, desktop and narrow widths. Not committed; not a test.
#   bash scripts/docs_screenshots.sh [OUTDIR]      (default build/screenshots; needs chromium: apt install chromium)
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-build/screenshots}
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
[ -n "$CHROMIUM" ] || { echo "no chromium on the PATH (Debian: apt install chromium)" >&2; exit 1; }
./dev docs build >/dev/null
mkdir -p "$OUTDIR"
PORT=${PORT:-8765}
.venv/bin/python -m http.server "$PORT" --bind 127.0.0.1 --directory build/site >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -fs "http://127.0.0.1:$PORT/" >/dev/null && break; sleep 0.1; done
shot() {  # name, path, width, height
  # The flags keep a closed network quiet (no background requests) and give each shot a fresh profile.
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --hide-scrollbars --user-data-dir="$(mktemp -d)" \
    --window-size="$3,$4" --screenshot="$OUTDIR/$1.png" "http://127.0.0.1:$PORT/$2" >/dev/null 2>&1
  echo "$OUTDIR/$1.png"
}
shot home "" 1400 1000
shot home-narrow "" 420 900
shot api-reference "reference/client/" 1400 1400
shot api-gpucompute "reference/client/#gpubroker.client.GpuCompute" 1400 1400
shot operator-guide "operator/" 1400 1000
shot operator-configuration "operator/configuration/" 1400 1400
