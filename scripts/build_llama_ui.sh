#!/usr/bin/env bash
# Build llama.cpp's own web UI (tools/ui of the pinned sources: SvelteKit, static output) for the
# browser test that chats through our router with it (tests/webui/test_llama_cpp_ui.py, make
# soak). Packages come from the npm registry (npm ci, install scripts off); the PWA icon step
# is skipped (vite build alone). Output in third_party/ (git-ignored). Idempotent. Prints the
# folder of the built UI as its last line; exit 3 when npm or the sources are missing.
set -euo pipefail

# shellcheck source=scripts/third_party.sh
source "$(dirname "${BASH_SOURCE[0]}")/third_party.sh"
UI_SRC="$LLAMA/tools/ui"
WORK="$TP/llama-ui-$VERSION"
DIST="$WORK/dist"

if [[ -f "$DIST/index.html" ]]; then
    log "already built"
    echo "$DIST"
    exit 0
fi
command -v npm >/dev/null || { log "no npm"; exit 3; }
if [[ ! -f "$UI_SRC/package.json" ]]; then
    log "no sources yet: scripts/build_llama_server.sh fetches and extracts them (and builds the reference)"
    "$ROOT/scripts/build_llama_server.sh" >/dev/null || true
fi
[[ -f "$UI_SRC/package.json" ]] || { log "no llama.cpp UI sources in $UI_SRC"; exit 3; }
rm -rf "$WORK/src" && mkdir -p "$WORK" && cp -r "$UI_SRC" "$WORK/src"
cd "$WORK/src"
log "npm ci (about 700 MB of packages; a minute)"
npm ci --no-audit --no-fund --ignore-scripts >&2
npx svelte-kit sync >&2
log "vite build"
LLAMA_UI_OUT_DIR="$DIST" npx vite build >&2
echo "$DIST"
