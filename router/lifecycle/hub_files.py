"""An `hf-repo` model's files (issue 48): the download its owner runs as an effect, and the preset
its worker then runs. The owner calls `download` through `ModelDeps.fetch`, the one function
that reaches outside (router.hub.pulls), so tests swap in a stand-in hub."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from router.hub.choice import Ref, parse_ref
from router.hub.download import HubError, Progress, Pulled
from router.lifecycle import messages as msg
from router.presets import ModelPreset

Fetch = Callable[[Ref, Callable[[Progress], None]], Awaitable[Pulled]]


def run_preset(p: ModelPreset, got: Pulled | None) -> ModelPreset:
    """The preset with the files its pull brought (the model, its projector, the backend the repo
    calls for, the repo's recommended sampling under the preset's own flags); else as it is."""
    if p.hf_repo is None or got is None:
        return p
    flags = dict(got.sampling) | dict(p.worker_args)
    return replace(p, model=got.model, mmproj=p.mmproj or got.mmproj,
                   backend=got.backend if p.backend == "auto" else p.backend,  # type: ignore[arg-type]
                   worker_args=tuple(sorted(flags.items())))


async def download(attempt: int, p: ModelPreset, fetch: Fetch,
                   progress: Callable[[dict[str, Any]], None]) -> msg.Fetched | msg.FetchFailed:
    """The files of `p` into the hub cache (a pull under way for the same reference is joined;
    leaving does not stop it: router.hub.pulls), as the owner's report."""
    assert p.hf_repo is not None

    def report(done: Progress) -> None:
        fraction = round(done.done / done.total, 4) if done.total else 0.0
        progress({"phase": "downloading", "file": done.file, "bytes_done": done.done,
                  "bytes_total": done.total, "fraction": fraction})

    try:
        pulled = await fetch(parse_ref(p.hf_repo, p.hf_file), report)
    except HubError as e:
        return msg.FetchFailed(attempt, f"{p.hf_repo}: {e}", e.is_transient, is_misconfigured=e.status == 404)
    except Exception as e:  # a surprise: never stay downloading
        return msg.FetchFailed(attempt, f"{p.hf_repo}: {type(e).__name__}: {e}", True)
    return msg.Fetched(attempt, pulled)
