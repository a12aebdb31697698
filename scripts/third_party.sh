# Sourced by the scripts that build from the pinned llama-cpp-python sdist into third_party/
# (build_llama_server.sh, build_llama_static_runtime.sh, build_llama_ui.sh): the version, the
# folders, the build knobs, and a log line named after the calling script.
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TP="$ROOT/third_party"
SRC="$TP/llama-cpp-python-$VERSION"
LLAMA="$SRC/vendor/llama.cpp"

log() { echo "[$(basename "$0" .sh)] $*" >&2; }
