#!/usr/bin/env bash
# Build llama.cpp's C++ llama-server from the sources vendored in the llama-cpp-python sdist
# we depend on, so the benchmark compares against exactly the llama.cpp revision our worker
# links. Sources and binary live under third_party/ (git-ignored; never committed).
#
# Idempotent: download, extract, configure and build are each skipped when already done.
# Prints the absolute path of the llama-server binary on stdout as its last line.
#
#   scripts/build_llama_server.sh            # default version (pyproject's pin)
#   JOBS=4 NICE=0 scripts/build_llama_server.sh
set -euo pipefail

# shellcheck source=scripts/third_party.sh
source "$(dirname "${BASH_SOURCE[0]}")/third_party.sh"
DIST="$TP/dist"
BUILD="$TP/llama-server-build-$VERSION"
BIN="$BUILD/bin/llama-server"

if [[ -x "$BIN" ]]; then
    log "already built"
    echo "$BIN"
    exit 0
fi

mkdir -p "$DIST"
SDIST="$(ls "$DIST"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [[ -z "$SDIST" ]]; then
    log "downloading llama-cpp-python==$VERSION sdist"
    "$PY" -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$DIST" >&2
    SDIST="$(ls "$DIST"/llama_cpp_python-"$VERSION".tar.gz)"
fi

if [[ ! -f "$LLAMA/CMakeLists.txt" ]]; then
    log "extracting $SDIST"
    tmp="$(mktemp -d "$TP/extract.XXXXXX")"
    tar -xzf "$SDIST" -C "$tmp"
    rm -rf "$SRC"
    mv "$tmp"/llama_cpp_python-"$VERSION" "$SRC"
    rmdir "$tmp"
fi

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    log "configuring in $BUILD"
    # Static libs: one self-contained binary, independent of the build tree's RPATH.
    cmake -S "$LLAMA" -B "$BUILD" \
        -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF \
        -DBUILD_SHARED_LIBS=OFF >&2
fi

log "building llama-server with -j$JOBS at nice $NICE (10-15 min on 2 cores)"
nice -n "$NICE" cmake --build "$BUILD" --target llama-server -j"$JOBS" >&2

if [[ ! -x "$BIN" ]]; then
    log "build finished but $BIN is missing"
    exit 1
fi
echo "$BIN"
