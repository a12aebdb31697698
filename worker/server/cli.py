"""`omni-worker`: one model behind an OpenAI-compatible HTTP server (what the router spawns).

The HTTP server is up at once; the engine thread loads the model meanwhile (/health: 503 with
progress, then 200; 500 and a non-zero exit if loading fails). SIGTERM, SIGINT and the death of
`--parent-pid` all take the same way out: fail in-flight requests, stop the server (1 s grace),
free the model, exit 0 (hard exit: no waiting on library threads).

Why one file of over 500 lines: llama-server's ~90 flags, each a typer option with its help
text, are most of it; what they configure lives in the modules they are handed to.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import cast

import typer
import uvicorn
from typer._click.exceptions import ClickException, NoSuchOption  # typer vendors its own click

from worker.backends import BackendOptions, load_backend, resolve_kind
from worker.backends.base import POOLINGS, Backend, Pooling
from worker.backends.lora import parse_scaled
from worker.backends.video import Sampling, VideoLimits
from worker.engine.disk_cache import fingerprint, kv_settings, parse_size
from worker.engine.disk_tier import SAVE_SECONDS, DiskCacheConfig
from worker.engine.engine import Engine, Progress
from worker.engine.metrics import WorkerMetrics
from worker.engine.speculation import SPEC_TYPES, SpecConfig, SpecType
from worker.protocol.defaults import DEFAULT_CTX, DEFAULT_PARALLEL
from worker.protocol.sampling import SamplingParams
from worker.protocol.speech import is_voice_file
from worker.server.media import (
    REMOTE_TIMEOUT_S,
    VIDEO_MAX_DECODED_PIXELS,
    VIDEO_MAX_SECONDS,
    VIDEO_MAX_STREAM_FRAMES,
    MediaPolicy,
)
from worker.server.state import REASONING_FORMATS, WorkerState

log = logging.getLogger("worker")
cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

_LOAD_FAILURE_GRACE_S = 1.0  # let /health report the 500 before exiting
# Default media limits, checked on the header before anything is decoded (worker/backends/
# media_probe.py). 50 megapixels: a 48 or 50 MP phone photo still goes in, while the vision
# encoders served here shrink every image to a few megapixels at most (SmolVLM: 1536 px on the
# longest side, 2.4 MP), so nothing a model can see is lost; a 50 MP decode is 150 MB of RGB.
# 30 minutes of audio: 115 MB of 16 kHz float samples once decoded, and more audio tokens than
# a slot's context holds (an audio encoder gives several tokens per second of sound).
IMAGE_MAX_PIXELS = 50_000_000
AUDIO_MAX_SECONDS = 1800.0
# Per request, summed over its items (up to --max-images 8, --max-audio 4), from the headers too:
# two 50 MP photos (300 MB of RGB decoded at most), an hour of audio, and 64 MiB of encoded
# media (three 20 MiB items; more does not fit the router's default 100 MiB body once in base64).
REQUEST_MAX_PIXELS = 100_000_000
REQUEST_MAX_AUDIO_SECONDS = 3600.0
REQUEST_MAX_MEDIA_BYTES = 64 * 1024 * 1024


class _Server(uvicorn.Server):
    """uvicorn that runs `on_exit` first and does not re-raise the signal (SIGTERM exits 0)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        log.info("signal %s: shutting down", signal.Signals(sig).name)
        self.request_exit()

    def request_exit(self) -> None:
        """Any thread (or a signal handler): fail in-flight work, then stop serving."""
        self._on_exit()
        self.should_exit = True


def _spec_config(kind: str, draft_model: str | None, n_max: int | None, n_min: int, p_min: float,
                 size_n: int, size_m: int) -> SpecConfig:
    """llama-server's --spec-* flags as a SpecConfig; what omni-worker does not run is refused."""
    kinds = [k.strip() for k in kind.split(",") if k.strip()] or ["none"]
    if draft_model is not None and kinds == ["none"]:
        kinds = ["draft-simple"]  # as llama-server: a draft model alone means draft-simple
    if len(kinds) > 1 or kinds[0] not in SPEC_TYPES:
        raise typer.BadParameter(f"{kind!r}: omni-worker runs one of {', '.join(SPEC_TYPES)}",
                                 param_hint="--spec-type")
    if kinds[0] == "draft-simple" and draft_model is None:
        raise typer.BadParameter("draft-simple needs a draft model: --spec-draft-model PATH",
                                 param_hint="--spec-type")
    if kinds[0] != "draft-simple" and draft_model is not None:
        raise typer.BadParameter(f"a draft model is for --spec-type draft-simple, not {kinds[0]}",
                                 param_hint="--spec-draft-model")
    if p_min > 0 and draft_model is None:
        raise typer.BadParameter("a draft model's minimum probability: there is no draft model (-md)",
                                 param_hint="--spec-draft-p-min")
    if draft_model is not None and not Path(draft_model).exists():
        raise typer.BadParameter(f"draft model not found: {draft_model}", param_hint="--spec-draft-model")
    return SpecConfig(cast(SpecType, kinds[0]), size_n=size_n, size_m=size_m, n_max=n_max, n_min=n_min,
                      p_min=p_min)


def _default_model_id(model_path: str) -> str:
    name = os.path.basename(os.path.normpath(model_path))
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def _setup_logging() -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _watch_parent(pid: int, server: _Server) -> None:
    import psutil

    while not server.should_exit:
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            log.info("parent process %d is gone: shutting down", pid)
            server.request_exit()
            return
        time.sleep(0.25)


_NO_URL = "omni-worker does not download a model from a URL: pass -hf ORG/REPO[:TAG] (a hub) or -m PATH"


def _from_hub(hf_repo: str | None, hf_file: str | None, model: str | None, mmproj: str | None,
              backend: str) -> tuple[str, str | None, str, dict[str, str]]:
    """llama-server's -hf: the repo's model (and projector) pulled into the hub cache first
    (router/hub: HF_ENDPOINT, HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE), then served from there;
    with the sampling its generation_config.json recommends (flag -> value)."""
    from router.hub.choice import parse_ref
    from router.hub.download import HubError, pull
    from router.hub.download import Progress as PullProgress

    if model is not None:
        raise typer.BadParameter("give -m PATH or -hf ORG/REPO[:TAG], not both", param_hint="--hf-repo")
    if hf_repo is None:
        raise typer.BadParameter("--hf-file names a file of the repo given by -hf ORG/REPO",
                                 param_hint="--hf-file")
    try:
        ref = parse_ref(hf_repo, hf_file)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--hf-repo") from None
    shown = [-1]

    def report(p: PullProgress) -> None:
        tenth = p.done * 10 // p.total if p.total else 10
        if tenth != shown[0]:
            shown[0] = tenth
            log.info("pulling %s: %d of %d bytes (%s)", ref, p.done, p.total, p.file)

    try:
        got = pull(ref, report)
    except HubError as e:
        raise typer.BadParameter(str(e), param_hint="--hf-repo") from None
    log.info("%s: %s (%s)", got.name, got.model, got.backend)
    mm = mmproj or (str(got.mmproj) if got.mmproj else None)
    return str(got.model), mm, got.backend if backend == "auto" else backend, dict(got.sampling)


_SAMPLING_PARAMS = {"temp": ("temperature", float), "top-p": ("top_p", float), "top-k": ("top_k", int),
                    "min-p": ("min_p", float), "repeat-penalty": ("repeat_penalty", float)}


def _recommended(sampling: dict[str, str], given: dict[str, float]) -> dict[str, float]:
    """`given` (parameter -> value) with a pulled repo's recommended sampling for each parameter
    the command line left at its default (a flag given wins)."""
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    out = dict(given)
    for flag, raw in sampling.items():
        name, kind = _SAMPLING_PARAMS.get(flag, ("", float))
        is_default = ctx is None or ctx.get_parameter_source(name) in (ParameterSource.DEFAULT, None)
        if name in out and is_default:
            out[name] = kind(float(raw))
            log.info("--%s %s: the repo's recommended sampling (generation_config.json)", flag, raw)
    return out


@cli.command()
def serve(
    model: str | None = typer.Option(None, "--model", "-m", help="GGUF file or HF model directory"),
    backend: str = typer.Option(
        "auto",
        "--backend",
        metavar="auto|llama_cpp|torch|piper",
        help="auto: llama.cpp for a .gguf file, torch for an HF folder, piper for a .onnx voice",
    ),
    alias: str | None = typer.Option(
        None,
        "--alias",
        "-a",
        help="model id reported by the API; comma-separated aliases: the first, sorted, is the id",
    ),
    tags: str | None = typer.Option(
        None, "--tags", help="comma-separated model tags (reported in /v1/models)"
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port"),
    uds: str | None = typer.Option(None, "--uds", help="listen on a unix socket instead of a port"),
    parallel: int = typer.Option(DEFAULT_PARALLEL, "--parallel", "-np", min=1, help="number of slots"),
    ctx_size: int = typer.Option(
        DEFAULT_CTX,
        "--ctx-size",
        "-c",
        min=0,
        help="KV cache cells in all (0: the model's); each slot gets ctx-size / parallel unless --kv-unified",
    ),
    kv_unified: bool = typer.Option(
        False,
        "--kv-unified",
        "-kvu",
        help="one KV cache that any slot may fill (llama.cpp: numerics then depend on what else runs)",
    ),
    batch_size: int = typer.Option(2048, "--batch-size", "-b", min=1, help="max tokens per decode step"),
    ubatch_size: int = typer.Option(512, "--ubatch-size", "-ub", min=1, help="physical batch size"),
    n_gpu_layers: str | None = typer.Option(
        None,
        "--n-gpu-layers",
        "--gpu-layers",
        "-ngl",
        metavar="N|auto|all",
        help="layers on the GPU (default: all)",
    ),
    split_mode: str | None = typer.Option(
        None, "--split-mode", "-sm", metavar="none|layer|row",
        help="llama.cpp backend: how the model spreads over several GPUs (default: layer)",
    ),
    tensor_split: str | None = typer.Option(
        None, "--tensor-split", "-ts", metavar="N0,N1,...",
        help="llama.cpp backend: each GPU's part of the model, e.g. 3,1 (default: by free memory)",
    ),
    main_gpu: int | None = typer.Option(
        None, "--main-gpu", "-mg", min=0,
        help="llama.cpp backend: the GPU for the whole model with --split-mode none (default: 0)",
    ),
    threads: int | None = typer.Option(None, "--threads", "-t", min=1),
    chat_template: str | None = typer.Option(
        None, "--chat-template", help="template file, builtin name or Jinja"
    ),
    chat_template_file: str | None = typer.Option(None, "--chat-template-file", help="Jinja template file"),
    lora: list[str] | None = typer.Option(
        None, "--lora", metavar="FNAME[,FNAME...]",
        help="LoRA adapter (GGUF file; an HF folder: a PEFT folder), comma-separated for several; "
             "ids 0, 1, ... in order, --lora ones before --lora-scaled ones",
    ),
    lora_scaled: list[str] | None = typer.Option(
        None, "--lora-scaled", metavar="FNAME:SCALE[,...]", help="LoRA adapter with its global scale",
    ),
    lora_runtime: bool = typer.Option(
        False, "--lora-runtime",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): adapters loaded at run time, "
             "from under --lora-allowed-path only",
    ),
    lora_allowed_path: str | None = typer.Option(
        None, "--lora-allowed-path", metavar="DIR",
        help="with --lora-runtime (which needs it): adapters are loaded only from under this directory, "
             "symlinks and '..' resolved",
    ),
    lora_init_without_apply: bool = typer.Option(
        False, "--lora-init-without-apply",
        help="load the adapters at scale 0 (set them later: POST /lora-adapters, or a request's `lora`)",
    ),
    jinja: bool = typer.Option(
        True,
        "--jinja/--no-jinja",
        help="templates are always Jinja; --no-jinja is accepted and changes nothing (a warning says so)",
    ),
    cache_type_k: str = typer.Option(
        "f16",
        "--cache-type-k",
        "-ctk",
        metavar="f16|f32|bf16|q8_0|q4_0|...",
        help="KV cache type for K (llama.cpp backend)",
    ),
    cache_type_v: str = typer.Option(
        "f16",
        "--cache-type-v",
        "-ctv",
        metavar="f16|f32|bf16|q8_0|q4_0|...",
        help="KV cache type for V (llama.cpp backend)",
    ),
    flash_attn: str = typer.Option("auto", "--flash-attn", "-fa", metavar="auto|on|off"),
    repack: bool | None = typer.Option(
        None,
        "--repack/--no-repack",
        " /-nr",
        envvar="LLAMA_ARG_REPACK",
        help="llama.cpp backend: weights in the CPU's extra buffer types (repacked for its kernels). "
        "Default: all but AMX, which crashes llama.cpp's decode; --repack: all (AMX too); --no-repack: none",
    ),
    device: str | None = typer.Option(None, "--device", help="torch backend: cpu, cuda, ..."),
    dtype: str | None = typer.Option(None, "--dtype", help="torch backend: float32, bfloat16, ..."),
    compile: bool = typer.Option(
        False,
        "--compile",
        help="torch backend on CUDA: CUDA graphs for decode steps (ignored, with a warning, on CPU)",
    ),
    cache_ram: int = typer.Option(
        8192,
        "--cache-ram",
        "-cram",
        min=-1,
        help="host-RAM prompt cache for idle slots' KV, in MiB (0: off, -1: no limit); llama.cpp backend",
    ),
    strict_reuse: bool = typer.Option(
        False,
        "--strict-reuse",
        help="reuse only KV rows computed as a fresh prompt would compute them (an answer never depends on "
        "what ran before); default: a conversation's earlier turns and shared prompts are reused",
    ),
    spec_type: str = typer.Option(
        "none", "--spec-type", metavar="none|ngram-simple|draft-simple",
        help="speculative decoding (README: when it helps); ngram-simple: prompt-lookup drafts",
    ),
    spec_draft_model: str | None = typer.Option(
        None, "--spec-draft-model", "-md", "--model-draft",
        help="a draft model of the same vocabulary (--spec-type draft-simple)",
    ),
    spec_draft_n_max: int | None = typer.Option(
        None, "--spec-draft-n-max", min=0,
        help="most tokens drafted per step (default: draft-simple 3, ngram-simple its size-m)",
    ),
    spec_draft_n_min: int = typer.Option(
        0, "--spec-draft-n-min", min=0, help="a shorter draft is not verified"
    ),
    spec_draft_p_min: float = typer.Option(
        0.0, "--spec-draft-p-min", "--draft-p-min", min=0.0, max=1.0,
        help="draft-simple: stop drafting below this probability",
    ),
    spec_ngram_simple_size_n: int = typer.Option(
        12, "--spec-ngram-simple-size-n", min=1, max=1024, help="ngram-simple: length of the n-gram looked up"
    ),
    spec_ngram_simple_size_m: int = typer.Option(
        48, "--spec-ngram-simple-size-m", min=1, max=1024, help="ngram-simple: most tokens one draft copies"
    ),
    cache_dir: str | None = typer.Option(
        None,
        "--cache-dir",
        help="folder of the disk prompt cache: cached prompts outlive the process (stop, sleep, restart); "
        "created if missing; off without it",
    ),
    cache_disk: str = typer.Option(
        "8G", "--cache-disk", metavar="SIZE", help="budget of --cache-dir (512M, 8G, bytes; 0: off)"
    ),
    reasoning_format: str = typer.Option(
        "auto",
        "--reasoning-format",
        metavar="auto|deepseek|deepseek-legacy|none",
        help="where <think> text goes (a request's reasoning_format wins)",
    ),
    reasoning: str = typer.Option(
        "auto",
        "--reasoning",
        "-rea",
        metavar="on|off|auto",
        help=(
            "the chat template's enable_thinking (a request's chat_template_kwargs win); auto: "
            "the template's default"
        ),
    ),
    # -- sampling defaults (a request's own fields win; GET /props reports these) --
    n_predict: int = typer.Option(
        -1, "--n-predict", "--predict", "-n", help="default and cap of max_tokens (-1: none)"
    ),
    temperature: float = typer.Option(0.8, "--temp", "--temperature", min=0.0),
    top_k: int = typer.Option(40, "--top-k"),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0),
    min_p: float = typer.Option(0.05, "--min-p", min=0.0, max=1.0),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", min=0.0),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", min=-1),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty"),
    seed: int = typer.Option(-1, "--seed", "-s", help="default seed (-1: a random one per request)"),
    # -- embedding models --
    embedding: bool = typer.Option(
        False,
        "--embedding",
        "--embeddings",
        help="an embedding model: /v1/embeddings, /embedding; no generation",
    ),
    pooling: str | None = typer.Option(
        None,
        "--pooling",
        metavar="none|mean|cls|last|rank",
        help="(default: the model's own)",
    ),
    rerank: bool = typer.Option(
        False, "--rerank", "--reranking", help="a reranker: --embedding --pooling rank, /rerank"
    ),
    # -- HTTP server --
    mmproj: str | None = typer.Option(
        None, "--mmproj", "-mm",
        help="a GGUF model's multimodal projector (image and/or audio input, through libmtmd)",
    ),
    image_max_pixels: int = typer.Option(
        IMAGE_MAX_PIXELS, "--image-max-pixels", min=0,
        help="refuse (400) an image of more pixels, read from its header before decoding (0: no limit)",
    ),
    max_images: int = typer.Option(8, "--max-images", min=0, help="images per request at most (400 over it)"),
    media_piece: int = typer.Option(
        16, "--media-piece", min=0,
        help="rows of an image's or audio's chunk per decode, cut at fixed rows so that generating slots "
        "are not held for a whole chunk (0: each chunk whole, as llama-server; see docs/vision.md)",
    ),
    audio_max_seconds: float = typer.Option(
        AUDIO_MAX_SECONDS, "--audio-max-seconds", min=0,
        help="refuse (400) audio longer than this, read from its header before decoding (0: no limit)",
    ),
    max_audio: int = typer.Option(
        4, "--max-audio", min=0, help="audio parts per request at most (400 over it)"
    ),
    max_videos: int = typer.Option(2, "--max-videos", min=0, help="videos per request at most (400 over it)"),
    video_fps: float = typer.Option(
        1.0, "--video-fps", min=0.001, max=60,
        help="frames a second sampled from a video (a request's video_fps overrides it)",
    ),
    video_max_frames: int = typer.Option(
        8, "--video-max-frames", min=1,
        help="frames sampled from one video at most, spread over it (a request's video_max_frames may "
        "ask fewer)",
    ),
    video_max_pixels: int = typer.Option(
        0, "--video-max-pixels", min=0,
        help="scale sampled frames down to this many pixels, aspect kept (0: their own size; a request's "
        "video_max_pixels overrides it)",
    ),
    video_max_seconds: float = typer.Option(
        VIDEO_MAX_SECONDS, "--video-max-seconds", min=0,
        help="refuse (400) a request's videos longer than this together, read from their headers before "
        "decoding (0: no limit)",
    ),
    video_max_stream_frames: int = typer.Option(
        VIDEO_MAX_STREAM_FRAMES, "--video-max-stream-frames", min=0,
        help="refuse (400) a request's videos of more frames than this together, read from their headers "
        "before decoding and counted while decoding (0: no limit)",
    ),
    video_max_decoded_pixels: int = typer.Option(
        VIDEO_MAX_DECODED_PIXELS, "--video-max-decoded-pixels", min=0,
        help="refuse (400) a request's videos whose frames times their pixels are more than this "
        "together (the decoder's work), read from their headers before decoding and counted while "
        "decoding (0: no limit)",
    ),
    request_max_pixels: int = typer.Option(
        REQUEST_MAX_PIXELS, "--request-max-pixels", min=0,
        help="refuse (400) a request whose images total more pixels, from their headers (0: no limit)",
    ),
    request_max_audio_seconds: float = typer.Option(
        REQUEST_MAX_AUDIO_SECONDS, "--request-max-audio-seconds", min=0,
        help="refuse (400) a request whose audio totals more seconds, from the headers (0: no limit)",
    ),
    request_max_media_bytes: int = typer.Option(
        REQUEST_MAX_MEDIA_BYTES, "--request-max-media-bytes", min=0,
        help="refuse (400) a request whose images, audio and videos total more bytes (0: no limit)",
    ),
    allowed_local_media_path: str | None = typer.Option(
        None, "--allowed-local-media-path", help="file:// image URLs are read only under this directory"
    ),
    allow_remote_media: bool = typer.Option(
        False, "--allow-remote-media",
        help="fetch http(s) image and video URLs (refused by default: 400), from public addresses only",
    ),
    allow_private_media: bool = typer.Option(
        False, "--allow-private-media",
        help="with --allow-remote-media: loopback and private addresses too (link-local and cloud "
             "metadata addresses stay refused)",
    ),
    remote_media_timeout: float = typer.Option(
        REMOTE_TIMEOUT_S, "--remote-media-timeout", min=0.1,
        help="seconds a remote media fetch may take in all (lookups, redirects, every read)",
    ),
    api_key: str | None = typer.Option(None, "--api-key", help="comma-separated keys; /health stays public"),
    api_key_file: str | None = typer.Option(None, "--api-key-file", help="a file of keys, one per line"),
    cors_origins: str = typer.Option(
        "*",
        "--cors-origins",
        help="* (any Origin is echoed back, as llama-server), localhost, or comma-separated origins",
    ),
    slots: bool = typer.Option(True, "--slots/--no-slots", help="GET /slots (501 with --no-slots)"),
    metrics_on: bool = typer.Option(False, "--metrics", help="GET /metrics (Prometheus); 501 without it"),
    sleep_idle_seconds: float = typer.Option(
        -1,
        "--sleep-idle-seconds",
        help=(
            "free the model after this many idle seconds (0 or -1: never, as omni-router's 0); a "
            "request wakes it"
        ),
    ),
    context_shift: bool = typer.Option(
        False,
        "--context-shift/--no-context-shift",
        help="omni-worker never shifts context (--no-context-shift)",
    ),
    offline: bool = typer.Option(False, "--offline", help="accepted: omni-worker never goes online"),
    hf_repo: str | None = typer.Option(
        None, "--hf-repo", "-hf", "-hfr", metavar="ORG/REPO[:TAG]",
        help="pull the model from a Hugging Face hub first (llama.cpp's choice of file; HF_ENDPOINT, "
        "HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE)"),
    hf_file: str | None = typer.Option(None, "--hf-file", "-hff", help="that file of the -hf repo"),
    model_url: str | None = typer.Option(None, "--model-url", "-mu", hidden=True),
    parent_pid: int | None = typer.Option(None, "--parent-pid", help="exit when this process is gone"),
    http_impl: str = typer.Option(
        "auto",
        "--http",
        metavar="auto|httptools|h11",
        help="uvicorn's HTTP implementation: auto (httptools, the fastest), httptools, "
        "or h11 (slower; the only one that sends header names as cased by us, "
        "e.g. Process-Start-Time-Unix, as llama-server does)",
    ),
    ui_mcp_proxy: bool = typer.Option(
        False,
        "--ui-mcp-proxy/--no-ui-mcp-proxy",
        help=(
            "/cors-proxy?url= for a web UI's MCP client (experimental, as llama-server's: never "
            "with untrusted clients)"
        ),
    ),
    props: bool = typer.Option(
        False, "--props", help="POST /props (it changes nothing, as in llama-server); 501 without"
    ),
    slot_save_path: str | None = typer.Option(
        None, "--slot-save-path", help="directory for POST /slots/{id}?action=save|restore (501 without it)"
    ),
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=lambda v: _print_version(v),
        help="print the version and exit",
    ),
    flags_json: bool = typer.Option(
        False,
        "--flags-json",
        is_eager=True,
        hidden=True,
        callback=lambda ctx, v: _print_flags(ctx, v),
        help="print every option as JSON and exit (the router's presets read it)",
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        "--log-verbose",
        help=(
            "every chat completion carries llama-server's `__verbose` object (the prompt as the "
            "model saw it)"
        ),
    ),
) -> None:
    """Serve one model with continuous batching over N slots (llama-server's flags, same names)."""
    _setup_logging()

    if model_url:
        raise typer.BadParameter(_NO_URL, param_hint="--model-url")
    if hf_repo or hf_file:
        model, mmproj, backend, sampling = _from_hub(hf_repo, hf_file, model, mmproj, backend)
        chosen = _recommended(sampling, {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                                         "min_p": min_p, "repeat_penalty": repeat_penalty})
        temperature, top_p, min_p, repeat_penalty = (chosen["temperature"], chosen["top_p"], chosen["min_p"],
                                                     chosen["repeat_penalty"])
        top_k = int(chosen["top_k"])
    if model is None:
        raise typer.BadParameter(
            "a model is required: -m PATH (a GGUF file or HF folder)", param_hint="--model"
        )
    if is_voice_file(model):  # a Piper voice: a speech worker (worker/speech/)
        if backend not in ("auto", "piper"):
            raise typer.BadParameter(f"{model!r} is a Piper voice: serve it with --backend piper (or auto)",
                                     param_hint="--backend")
        _serve_voice(model, alias, host, port, uds, threads, parent_pid, _api_keys(api_key, api_key_file),
                     cors_origins, metrics_on)
        return
    if context_shift:
        raise typer.BadParameter(
            "omni-worker does not shift context: a request stops with finish_reason length "
            "when its slot is full (leave it out or pass --no-context-shift)",
            param_hint="--context-shift",
        )
    if reasoning not in ("on", "off", "auto"):
        raise typer.BadParameter(f"{reasoning!r} is not one of on, off, auto", param_hint="--reasoning")
    if http_impl not in ("auto", "httptools", "h11"):
        raise typer.BadParameter(f"{http_impl!r} is not one of auto, httptools, h11", param_hint="--http")
    if slot_save_path is not None and not os.path.isdir(slot_save_path):
        raise typer.BadParameter(f"{slot_save_path!r} is not a directory", param_hint="--slot-save-path")
    try:
        cache_disk_bytes = parse_size(cache_disk)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--cache-disk") from None
    if chat_template and chat_template_file:
        raise typer.BadParameter(
            "give --chat-template or --chat-template-file, not both", param_hint="--chat-template-file"
        )
    if not jinja:
        log.warning(
            "--no-jinja: omni-worker always renders chat templates with Jinja "
            "(the model's, or --chat-template)"
        )
    if backend not in ("auto", "llama_cpp", "torch"):
        raise typer.BadParameter(f"{backend!r} is not one of auto, llama_cpp, torch", param_hint="--backend")
    if batch_size < parallel:
        raise typer.BadParameter(
            f"must be at least --parallel ({parallel}): every generating slot adds a token per step",
            param_hint="--batch-size",
        )
    if reasoning_format not in REASONING_FORMATS:
        raise typer.BadParameter(f"{reasoning_format!r} is not one of {', '.join(REASONING_FORMATS)}",
                                 param_hint="--reasoning-format")
    if pooling is not None and pooling not in POOLINGS:
        raise typer.BadParameter(f"{pooling!r} is not one of {', '.join(POOLINGS)}", param_hint="--pooling")
    if rerank:
        if pooling not in (None, "rank"):
            raise typer.BadParameter("--rerank pools with rank: leave --pooling out", param_hint="--pooling")
        embedding, pooling = True, "rank"
    if pooling is not None and not embedding:
        raise typer.BadParameter(
            "pools an embedding model's outputs: add --embedding", param_hint="--pooling"
        )
    if embedding:
        # As llama-server: a prompt is pooled in one ubatch, so a batch is one ubatch; and the
        # tasks are stateless, so there is no prompt cache to keep.
        if batch_size > ubatch_size:
            log.info("--embedding: batch size %d -> %d (the ubatch size)", batch_size, ubatch_size)
            batch_size = ubatch_size
        if batch_size < parallel:
            raise typer.BadParameter(f"must be at least --parallel ({parallel})", param_hint="--ubatch-size")
        cache_ram = 0
    try:
        lora_specs = _lora_specs(lora or [], lora_scaled or [], lora_init_without_apply)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--lora-scaled") from None
    if lora_specs and embedding:
        raise typer.BadParameter("adapters are for a generating model, not --embedding", param_hint="--lora")
    spec = _spec_config(spec_type, spec_draft_model, spec_draft_n_max, spec_draft_n_min, spec_draft_p_min,
                        spec_ngram_simple_size_n, spec_ngram_simple_size_m)
    try:
        kind = resolve_kind(backend, model)  # type: ignore[arg-type]  # typer gives a str; resolve_kind checks it
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None
    if mmproj is not None and (kind != "llama_cpp" or embedding):
        raise typer.BadParameter("a projector for a GGUF generating model (llama.cpp backend) only",
                                 param_hint="--mmproj")
    if lora_runtime and lora_allowed_path is None:
        raise typer.BadParameter("loading adapters at run time needs the folder they may come from: "
                                 "--lora-allowed-path DIR", param_hint="--lora-runtime")
    if lora_allowed_path is not None and not os.path.isdir(lora_allowed_path):
        raise typer.BadParameter(f"{lora_allowed_path!r} is not a directory",
                                 param_hint="--lora-allowed-path")
    if allowed_local_media_path is not None and not os.path.isdir(allowed_local_media_path):
        raise typer.BadParameter(f"{allowed_local_media_path!r} is not a directory",
                                 param_hint="--allowed-local-media-path")
    options = BackendOptions(
        mmproj=mmproj,
        image_max_pixels=image_max_pixels,
        audio_max_seconds=audio_max_seconds,
        n_ctx=ctx_size,
        n_slots=parallel,
        kv_unified=kv_unified,
        n_batch=batch_size,
        n_ubatch=ubatch_size,
        n_gpu_layers=_gpu_layers(n_gpu_layers),
        split_mode=_split_mode(split_mode),
        tensor_split=_tensor_split(tensor_split),
        main_gpu=main_gpu or 0,
        threads=threads,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
        flash_attn=flash_attn,
        repack="auto" if repack is None else "on" if repack else "off",
        device=device,
        dtype=dtype,
        compile=compile,
        embedding=embedding,
        pooling=cast(Pooling | None, pooling),
    )
    defaults = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        seed=seed if seed >= 0 else None, max_tokens=n_predict if n_predict >= 0 else None,
    )
    disk = None
    has_file = model is not None and Path(model).exists()  # if not: no disk tier, the load says why
    if cache_dir is not None and cache_disk_bytes > 0 and cache_ram != 0 and model is not None and has_file:
        fp = fingerprint(model, kv_settings(kind, options, media_piece))
        disk = DiskCacheConfig(Path(cache_dir), cache_disk_bytes, fp)
    api_keys = _api_keys(api_key, api_key_file)
    metrics = WorkerMetrics()
    exit_code = 0
    server: _Server | None = None

    def on_load_failed() -> None:  # engine thread
        nonlocal exit_code
        exit_code = 1
        # Leave /health a moment to report the 500 before the process goes away.
        threading.Timer(_LOAD_FAILURE_GRACE_S, exit_now).start()

    def exit_now() -> None:
        if server is not None:
            server.request_exit()

    engine = Engine(
        _loader(kind, model, options, chat_template or chat_template_file, lambda: state), parallel, metrics,
        on_load_failed,
        cache_ram_mib=cache_ram,
        strict_reuse=strict_reuse,
        media_piece=media_piece,
        spec=spec,
        draft_factory=_draft_loader(spec_draft_model, options) if spec_draft_model is not None else None,
        disk_cache=disk,
        lora=lora_specs,
    )
    aliases = tuple(sorted(set(_split(alias))))  # llama-server keeps them in a std::set
    state = WorkerState(
        engine,
        metrics,
        aliases[0] if aliases else _default_model_id(model),
        model,
        kind,
        reasoning_format=reasoning_format,
        defaults=defaults,
        tags=_split(tags),
        aliases=aliases,
        is_slots_on=slots,
        is_metrics_on=metrics_on,
        is_embedding=embedding,
        is_verbose=verbose,
        is_props_on=props,
        is_lora_runtime_on=lora_runtime,
        lora_allowed_path=lora_allowed_path,
        slot_save_path=slot_save_path,
        is_cors_proxy_on=ui_mcp_proxy,
        template_kwargs={} if reasoning == "auto" else {"enable_thinking": reasoning == "on"},
        media=MediaPolicy(
            allowed_local_media_path, allow_remote_media, max_images, max_audio, max_videos,
            VideoLimits(image_max_pixels, video_max_seconds, video_max_stream_frames,
                        video_max_decoded_pixels),
            Sampling(video_fps, video_max_frames, max_pixels=video_max_pixels),
            request_max_pixels=request_max_pixels, request_max_audio_seconds=request_max_audio_seconds,
            request_max_media_bytes=request_max_media_bytes,
            allow_private_remote=allow_private_media, remote_timeout_s=remote_media_timeout,
        ),
    )
    engine.start()  # the model loads while the HTTP stack is imported
    from worker.server.routes import build_app

    config = uvicorn.Config(
        build_app(state, api_keys=api_keys, cors_origins=cors_origins),
        host=host,
        port=port,
        uds=uds,
        log_level="warning",
        http=http_impl,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    server = _Server(
        config, on_exit=lambda: engine.stop(timeout=0)
    )  # failing in-flight requests ends their streams
    if sleep_idle_seconds > 0:
        threading.Thread(
            target=_sleep_when_idle, args=(engine, sleep_idle_seconds, server), name="idle-sleep", daemon=True
        ).start()
    if parent_pid is not None:
        threading.Thread(
            target=_watch_parent, args=(parent_pid, server), name="parent-watch", daemon=True
        ).start()
    log.info(
        "omni-worker: model %s (backend %s), %d slots, listening on %s",
        model,
        kind,
        parallel,
        uds or f"{host}:{port}",
    )
    hosts = _split(host)
    if uds is None and len(hosts) > 1:  # llama-server's --host a,b: one listening socket per address
        try:
            sockets = [_listen(h, port) for h in hosts]
        except OSError as e:
            log.error("cannot listen on %s port %d: %s", host, port, e)
            os._exit(1)
        server.run(sockets=sockets)
    else:
        server.run()
    engine.stop(timeout=1.0 + SAVE_SECONDS)  # the disk prompt cache is written as the engine stops
    log.info("exit %d", exit_code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _serve_voice(model: str, alias: str | None, host: str, port: int, uds: str | None,
                 threads: int | None, parent_pid: int | None, api_keys: tuple[str, ...], cors_origins: str,
                 metrics_on: bool) -> None:
    from worker.speech.serve import SpeechOptions, serve_speech

    if not os.path.isfile(model):
        raise typer.BadParameter(f"{model!r} does not exist", param_hint="--model")
    aliases = tuple(sorted(set(_split(alias))))
    model_id = aliases[0] if aliases else _default_model_id(model)
    serve_speech(SpeechOptions(model, model_id, aliases, host, port, uds, threads, parent_pid, api_keys,
                               cors_origins, metrics_on))


def _print_version(is_asked: bool) -> None:
    if is_asked:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            print(f"omni-worker {package_version('omni-router')}")
        except PackageNotFoundError:  # run from a checkout that was not installed
            print("omni-worker (not installed: version unknown)")
        raise typer.Exit(0)


def _print_flags(ctx: typer.Context, is_asked: bool) -> None:
    """`--flags-json`: this command line's options, for router.worker_flags (presets pass any of
    them through). The contract is the command line itself, so the router reads it from here."""
    if not is_asked:
        return
    import json

    out = []
    for p in ctx.command.params:
        annotation = p.type_descriptor.annotation  # type: ignore[attr-defined]
        kinds = [t for t in getattr(annotation, "__args__", (annotation,)) if t is not type(None)]
        kind = kinds[0].__name__ if len(kinds) == 1 and kinds[0] in (int, float, bool) else "str"
        out.append({"opts": list(p.opts), "secondary_opts": list(p.secondary_opts), "hidden": bool(p.hidden),  # type: ignore[attr-defined]
                    "is_flag": bool(getattr(p, "is_flag", False)), "type": kind, "help": p.help or "",  # type: ignore[attr-defined]
                    "min": getattr(p, "min", None), "max": getattr(p, "max", None)})
    print(json.dumps(out))
    raise typer.Exit(0)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host.strip("[]"), port))
    sock.set_inheritable(True)
    return sock


def _lora_specs(plain: list[str], scaled: list[str], without_apply: bool) -> tuple[tuple[str, float], ...]:
    """--lora / --lora-scaled (each repeatable, comma-separated) -> (path, global scale) by id."""
    out = [(p, 1.0) for v in plain for p in _split(v)] + [parse_scaled(x) for v in scaled for x in _split(v)]
    return tuple((p, 0.0 if without_apply else s) for p, s in out)


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _api_keys(keys: str | None, path: str | None) -> tuple[str, ...]:
    out = _split(keys)
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise typer.BadParameter(
                f"cannot read {path}: {e.strerror}", param_hint="--api-key-file"
            ) from None
        out += tuple(line.strip() for line in lines if line.strip())
    return out


def _gpu_layers(value: str | None) -> int | None:
    """llama-server's -ngl: a number, auto or all; our backends offload all when it is None."""
    if value is None or value in ("auto", "all"):
        return None
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not a number, auto or all", param_hint="--n-gpu-layers"
        ) from None


def _split_mode(value: str | None) -> str:
    if value is None:
        return "layer"
    if value not in ("none", "layer", "row"):
        raise typer.BadParameter(f"{value!r} is not one of none, layer, row", param_hint="--split-mode")
    return value


def _tensor_split(value: str | None) -> tuple[float, ...]:
    """llama-server's `-ts 3,1` (or `3/1`): each device's part; () = llama.cpp's own split."""
    if not value:
        return ()
    try:
        parts = tuple(float(v) for v in value.replace("/", ",").split(",") if v.strip())
    except ValueError:
        parts = ()
    if not parts or min(parts) < 0 or not sum(parts):
        raise typer.BadParameter(f"{value!r}: expected non-negative numbers like 3,1",
                                 param_hint="--tensor-split")
    return parts


def _sleep_when_idle(engine: Engine, idle_s: float, server: _Server) -> None:
    """`--sleep-idle-seconds`: ask the engine, now and then, to sleep if it has been idle that long;
    it decides on its own thread (`sleep_if_idle_for`), so a request arriving meanwhile wins."""
    period = min(1.0, idle_s / 4)
    while not server.should_exit:
        time.sleep(period)
        backend = engine.backend
        if backend is not None and not backend.is_sleeping and time.monotonic() - engine.last_busy >= idle_s:
            engine.call_when_idle(lambda: engine.sleep_if_idle_for(idle_s)).result()


def _loader(
    kind: str,
    model: str,
    options: BackendOptions,
    chat_template: str | None,
    state: Callable[[], WorkerState],
) -> Callable[[Progress], Backend]:
    """The engine's backend factory: load the model, then its chat template (engine thread)."""

    def load(progress: Progress) -> Backend:
        from worker.text.chat_template import load_chat_template

        backend = load_backend(kind, model, options, progress)  # type: ignore[arg-type]  # model was checked to exist above
        meta = backend.meta
        template = state().template = load_chat_template(
            chat_template, meta.chat_template, bos_token=meta.bos_token, eos_token=meta.eos_token
        )
        if not template.caps.supports_tools:
            log.warning("the chat template (%s) cannot render tools: a request with tools gets the generic "
                        "tool prompt (worker/text/generic_tools.py)", template.name)
        state().eog_ids = tuple(t for t in range(meta.n_vocab) if backend.is_eog(t))
        return backend

    return load


def _draft_loader(path: str, options: BackendOptions) -> Callable[[Progress], Backend]:
    """The draft model's factory (--spec-draft-model): the model's backend options, its own backend kind."""
    try:
        kind = resolve_kind("auto", path)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--spec-draft-model") from None

    def load(progress: Progress) -> Backend:
        return load_backend(kind, path, options, progress)

    return load


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`omni-worker`): a bad or unknown flag is one line and exit 2."""
    command = typer.main.get_command(cli)
    try:
        command.main(
            args=argv if argv is not None else sys.argv[1:], prog_name="omni-worker", standalone_mode=False
        )
    except NoSuchOption as e:
        print(
            f"omni-worker: error: unknown option {e.option_name}: omni-worker does not implement it "
            "(see omni-worker --help for the llama-server flags it takes)",
            file=sys.stderr,
        )
        sys.exit(2)
    except ClickException as e:
        print(f"omni-worker: error: {e.format_message()}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)


if __name__ == "__main__":
    main()
