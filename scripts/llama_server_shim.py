#!/usr/bin/env python3
"""Stand-in for the `llama-server` binary: llama-server's command line in, omni-worker out.

llama.cpp's server test-suite (tools/server/tests, driven by scripts/llama_server_suite.py) starts
whatever LLAMA_SERVER_BIN_PATH names with llama-server flags, on models it downloads from the HF
hub. This script takes those flags, puts the local GGUF in env OMNI_SHIM_MODEL (default
models/tiny-llama-f32.gguf under the repo root) in place of the model, and execs

- omni-worker (`python -m worker.server.cli`, with the Python running this script), or
- the reference llama-server named by env OMNI_SHIM_LLAMA_SERVER: the flags pass through
  untouched but for the model, so both servers run the same tiny model.

exec keeps the pid, so the suite's SIGTERM reaches the server itself. Env OMNI_SHIM_WORKER_ARGS
(shell-split) is appended to omni-worker's arguments, e.g. "--backend torch", or "--batch-size 512"
to override a preset's value (the last one wins).

How each llama-server flag is treated (omni-worker mode):

mapped       --port --host -a/--alias -c/--ctx-size -np/--parallel -b/--batch-size
             -ub/--ubatch-size -t/--threads -ngl/--gpu-layers/--n-gpu-layers
             -ctk/--cache-type-k -ctv/--cache-type-v -fa/--flash-attn -cram/--cache-ram
             -kvu/--kv-unified, --reasoning-format (omni-worker refuses values it lacks, e.g.
             nothink), --chat-template and --chat-template-file (both -> --chat-template:
             omni-worker takes a file, a builtin name or inline Jinja with {{ or {%; llama-server
             takes any other text as the template itself, where omni-worker fails to load)
defaulted    no -np: llama-server's "auto" is 4 slots sharing one KV cache, so the shim adds
             --parallel 4 --kv-unified (omni-worker's own default is 4 slots, a stream each);
             always --http h11: uvicorn's default HTTP implementation (httptools) lowercases
             response header names, and the suite reads headers from a plain dict
             (`"Process-Start-Time-Unix" in res.headers`, `res.headers["Access-Control-Allow-Origin"]`);
             h11 sends them as llama-server does (omni-worker's own default stays the faster one)
model        -m/--model -hf/-hfr/--hf-repo -hff/--hf-file -mu/--model-url --offline:
             dropped; --model OMNI_SHIM_MODEL instead (also in llama-server mode)
passed       omni-worker takes these as llama-server does (flag and value unchanged): --jinja
             --no-jinja --metrics --slots --no-slots --props --ui-mcp-proxy --context-shift (refused)
             --no-context-shift -s/--seed -n/--predict/--n-predict --temp/--temperature
             --api-key --tags --sleep-idle-seconds --cors-origins --slot-save-path -rea/--reasoning
             -v/--verbose/--log-verbose (responses carry `__verbose`)
             --embedding/--embeddings --rerank/--reranking --pooling
             --lora --lora-scaled --lora-init-without-apply (LoRA adapters: the suite's test_lora.py
             gets a local stand-in adapter for the tiny model, see llama_server_suite.py)
ignored      no effect on what omni-worker does: -cb/--cont-batching (always on),
             --no-ui/--no-webui (the worker serves no web UI),
             -lv/--verbosity/--log-verbosity, --no-mmproj/--no-mmproj-auto (text only)
refused      everything else: exit 2 naming the flag, so a test that needs it fails loudly
             instead of passing by accident. Among them --model-draft/--spec-*, --grp-attn-n/-w,
             --no-cache-idle-slots, --swa-full, --mmproj-url, --media-path,
             --models-dir/--models-max/--models-preset (router mode), --tools, --mcp-servers-*,
             --backend_sampling.

Usage (normally by the suite): LLAMA_SERVER_BIN_PATH points at a two-line shell wrapper that runs
`<venv python> scripts/llama_server_shim.py "$@"`. By hand:
    .venv/bin/python scripts/llama_server_shim.py --port 8080 --hf-repo x/y --ctx-size 512
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "tiny-llama-f32.gguf"
EXIT_REFUSED = 2

MAPPED: dict[str, str] = {  # llama-server flag (takes a value) -> omni-worker flag
    "--port": "--port", "--host": "--host",
    "-a": "--alias", "--alias": "--alias",
    "-c": "--ctx-size", "--ctx-size": "--ctx-size",
    "-np": "--parallel", "--parallel": "--parallel",
    "-b": "--batch-size", "--batch-size": "--batch-size",
    "-ub": "--ubatch-size", "--ubatch-size": "--ubatch-size",
    "-t": "--threads", "--threads": "--threads",
    "-ngl": "--n-gpu-layers", "--gpu-layers": "--n-gpu-layers", "--n-gpu-layers": "--n-gpu-layers",
    "-ctk": "--cache-type-k", "--cache-type-k": "--cache-type-k",
    "-ctv": "--cache-type-v", "--cache-type-v": "--cache-type-v",
    "-fa": "--flash-attn", "--flash-attn": "--flash-attn",
    "-cram": "--cache-ram", "--cache-ram": "--cache-ram",
    "--chat-template": "--chat-template", "--chat-template-file": "--chat-template",
    "--reasoning-format": "--reasoning-format",  # omni-worker checks the value (it has no "nothink")
}
MAPPED_SWITCHES: dict[str, str] = {"-kvu": "--kv-unified", "--kv-unified": "--kv-unified"}
MODEL_FLAGS = {"-m", "--model", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url"}
MODEL_SWITCHES = {"--offline"}
IGNORED_SWITCHES = {
    "-cb", "--cont-batching", "--no-ui", "--no-webui", "--no-mmproj",
    "--no-mmproj-auto",
}
IGNORED_FLAGS = {"-lv", "--verbosity", "--log-verbosity"}
PASSED_SWITCHES = {
    "--jinja", "--no-jinja", "--metrics", "--slots", "--no-slots", "--context-shift", "--no-context-shift",
    "-v", "--verbose", "--log-verbose", "--props", "--ui-mcp-proxy", "--no-ui-mcp-proxy",
    "--embedding", "--embeddings", "--rerank", "--reranking", "--lora-init-without-apply",
}
PASSED_FLAGS = {
    "-s", "--seed", "-n", "--predict", "--n-predict", "--temp", "--temperature", "--api-key", "--tags",
    "--sleep-idle-seconds", "--cors-origins", "--slot-save-path", "-rea", "--reasoning", "--pooling",
    "--lora", "--lora-scaled",
}
REASONS = {  # refused flags whose reason is worth more than "no equivalent"
    "--model-draft": "no speculative decoding",
}
TAKES_VALUE = set(MAPPED) | MODEL_FLAGS | IGNORED_FLAGS | PASSED_FLAGS


class Refused(Exception):
    """A flag whose meaning omni-worker lacks: the server must not start."""


def split_args(argv: list[str]) -> list[tuple[str, str | None]]:
    """[(flag, value or None)]: `--flag=value` split, a known flag's value taken whatever it looks
    like (`--cache-ram -1`), an unknown flag's value if the next word is not a flag."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        i += 1
        if eq:
            out.append((flag, value))
        elif flag in TAKES_VALUE or (i < len(argv) and not argv[i].startswith("-")):
            if i >= len(argv):
                raise Refused(f"{flag} needs a value")
            out.append((flag, argv[i]))
            i += 1
        else:
            out.append((flag, None))
    return out


def to_omni_worker(argv: list[str], model: Path) -> list[str]:
    """omni-worker's arguments for llama-server's `argv`; Refused if a flag has no equivalent."""
    out = ["--model", str(model)]
    has_parallel = False
    for flag, value in split_args(argv):
        if flag in MAPPED and value is not None:
            out += [MAPPED[flag], value]
            has_parallel = has_parallel or MAPPED[flag] == "--parallel"
        elif flag in MAPPED_SWITCHES and value is None:
            out.append(MAPPED_SWITCHES[flag])
        elif (
            flag in MODEL_FLAGS or flag in MODEL_SWITCHES or flag in IGNORED_SWITCHES or flag in IGNORED_FLAGS
        ):
            continue
        elif flag in PASSED_SWITCHES and value is None:
            out.append(flag)
        elif flag in PASSED_FLAGS and value is not None:
            out += [flag, value]
        else:
            raise Refused(f"{flag}: {REASONS.get(flag, 'omni-worker has no equivalent')}")
    if not has_parallel:  # llama-server's -np auto: 4 slots, one KV cache for all
        out += ["--parallel", "4", "--kv-unified"]
    return [*out, "--http", "h11"]  # header names as llama-server cases them (see the module docstring)


def to_llama_server(argv: list[str], model: Path) -> list[str]:
    """llama-server's own `argv`, the model replaced by the local one; everything else as it was."""
    out = ["--model", str(model)]
    i = 0
    while i < len(argv):
        flag = argv[i].partition("=")[0]
        takes_next = flag in MODEL_FLAGS and "=" not in argv[i]
        if flag not in MODEL_FLAGS and flag not in MODEL_SWITCHES:
            out.append(argv[i])
        i += 2 if takes_next else 1
    return out


def main(argv: list[str]) -> int:
    model = Path(os.environ.get("OMNI_SHIM_MODEL") or DEFAULT_MODEL).resolve()
    if not model.exists():
        print(
            f"llama_server_shim: model {model} not found (make models, or set OMNI_SHIM_MODEL)",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    upstream = os.environ.get("OMNI_SHIM_LLAMA_SERVER")
    if upstream:
        args = to_llama_server(argv, model)
        print(f"llama_server_shim: exec {upstream} {' '.join(args)}", file=sys.stderr, flush=True)
        os.execv(upstream, [upstream, *args])
    try:
        args = to_omni_worker(argv, model)
    except (Refused, ValueError) as e:
        print(f"llama_server_shim: refusing to start omni-worker: {e}", file=sys.stderr)
        return EXIT_REFUSED
    cmd = [
        sys.executable,
        "-m",
        "worker.server.cli",
        *args,
        *shlex.split(os.environ.get("OMNI_SHIM_WORKER_ARGS", "")),
    ]
    print(f"llama_server_shim: exec {' '.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
