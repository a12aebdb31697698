"""The startup summary the router prints: the models it found, where the UI is, where the logs go. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from router.lifecycle.eviction import format_size
from router.lifecycle.gpus import Gpu
from router.presets import ModelPreset


def banner(
    presets: list[ModelPreset], host: str, port: int, *, has_api_key: bool, log_level: str,
    gpus: Sequence[Gpu] = (), gpu_reserve: str = "",
) -> list[str]:
    shown_host = f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)
    url = f"http://{shown_host}:{port}"
    missing = [p for p in presets if p.model_error is not None]
    lines = [f"omni-router: {len(presets)} model{'s' if len(presets) != 1 else ''}"
             + (f", {len(missing)} with a missing file (failed; the others serve)" if missing else "")]
    for p in presets:
        what = p.upstream if p.is_remote else (p.cmd if p.backend == "cmd" else str(p.model))
        state = (
            "MISSING FILE"
            if p.model_error
            else ("loads at startup" if p.load_on_startup else "loads on first use")
        )
        aliases = f" (aliases: {', '.join(p.aliases)})" if p.aliases else ""
        lines.append(f"  {p.name}{aliases}: {what} [{p.backend}; {state}]")
    lines += [f"  {m.model_error}" for m in missing]
    if gpus:  # the GPU placement's devices (router.lifecycle.gpus)
        lines.append(f"GPUs: {len(gpus)} (each model placed on those with room; --gpu-reserve {gpu_reserve} "
                     "kept free on each)")
        lines += [f"  GPU {g.index}: {g.name} ({g.uuid}), {format_size(g.total_bytes)}, "
                  f"{format_size(g.total_bytes - g.used_bytes)} free" for g in gpus]
    lines.append(f"web UI: {url}/   OpenAI API: {url}/v1   (model list: {url}/v1/models"
                 + (", API key required)" if has_api_key else ")"))
    lines.append(f"logs: this console at {log_level} (--log-level debug for each worker's output); "
                 f"{url}/logs and {url}/logs?model=NAME (last lines), /logs/stream (live)")
    return lines
