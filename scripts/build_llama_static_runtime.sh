#!/usr/bin/env bash
# Build llama.cpp's shared libraries (libllama, libggml*, libmtmd) from the pinned sources with
# the C++ runtime linked into each library and exported (-static-libstdc++), as the CUDA build
# on the lent GPU's toolchain came out: the case worker/backends/cxx_runtime.py exists for,
# reproduced on a CPU. Used by tests/yardstick/test_static_runtime_build.py (make soak).
# Sources come from scripts/build_llama_server.sh's extraction; the build lives in third_party/
# (git-ignored). Idempotent. Prints the folder of the libraries as its last line.
set -euo pipefail

# shellcheck source=scripts/third_party.sh
source "$(dirname "${BASH_SOURCE[0]}")/third_party.sh"
BUILD="$TP/llama-static-runtime-$VERSION"
LIBS="$BUILD/bin"

if [[ -f "$LIBS/libllama.so" && -f "$LIBS/libmtmd.so" ]]; then
    log "already built"
    echo "$LIBS"
    exit 0
fi
if [[ ! -f "$LLAMA/CMakeLists.txt" ]]; then
    log "no sources yet: scripts/build_llama_server.sh fetches and extracts them (and builds the reference)"
    "$ROOT/scripts/build_llama_server.sh" >/dev/null || true
fi
[[ -f "$LLAMA/CMakeLists.txt" ]] || { log "no llama.cpp sources in $LLAMA"; exit 3; }

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DCMAKE_SHARED_LINKER_FLAGS="-static-libstdc++ -static-libgcc" \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF >&2
fi
log "building libllama and libmtmd with -j$JOBS at nice $NICE (about 10 minutes on 2 cores)"
nice -n "$NICE" cmake --build "$BUILD" --target llama mtmd -j"$JOBS" >&2
echo "$LIBS"
