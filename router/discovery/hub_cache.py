"""Every GGUF repo in the Hugging Face hub cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub), as llama.cpp's router lists them: one model per quantisation of each
repo's current snapshot (`refs/main`), named `org/repo:TAG`, with the repo's projector and its
generation_config.json sampling, as a pull would bring them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.hub.choice import ChoiceError, choose, parse_ref, tags_of
from router.hub.download import HubConfig, list_cached
from router.presets import ModelPreset, discovered_preset


def scan(overrides: Mapping[str, Any] | None = None) -> list[ModelPreset]:
    cfg = HubConfig.from_env()
    if not cfg.cache_dir.is_dir():
        return []
    found = []
    for folder in sorted(cfg.cache_dir.glob("models--*--*")):
        repo = folder.name[len("models--"):].replace("--", "/", 1)
        try:
            ref = parse_ref(repo)
        except ValueError:
            continue
        listing = list_cached(cfg, ref)
        if listing is None:
            continue
        snapshot = cfg.repo_folder(repo) / "snapshots" / listing.commit
        for tag in tags_of(list(listing.files)):
            try:
                choice = choose(parse_ref(f"{repo}:{tag}"), list(listing.files))
            except ChoiceError:
                continue  # (a split model missing a part)
            from router.hub.download import read_sampling

            found.append(discovered_preset(
                f"{repo}:{tag}", snapshot / choice.model, f"hub cache {folder}",
                mmproj=snapshot / choice.mmproj if choice.mmproj else None,
                worker_args=read_sampling(snapshot / "generation_config.json"), overrides=overrides))
    return found
