"""Pulls from a stand-in hub (worker/testing/stand_in_hub.py, a real HTTP server) into a
temporary hub cache: by tag, the default tag, a split model with its projector, a safetensors
repo, the 404 that lists tags, the hub down, HF_HUB_OFFLINE, a download cut halfway that
resumes, a corrupt file refused, a full disk, and two asks sharing one download."""

from __future__ import annotations

import asyncio
import os
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.hub.choice import parse_ref
from router.hub.download import HubConfig, HubError, Progress, pull
from router.hub.pulls import Pulls
from tests.util import free_port, wait_until
from worker.testing.stand_in_hub import StandInHub

BIG = 300 * 1024  # several 64 KiB steps of the stand-in's transfer


def blob(seed: int, size: int = BIG) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(size))


@pytest.fixture
def hub(tiny_split: list[Path]) -> Iterator[StandInHub]:
    with StandInHub() as h:
        h.add_repo("omni/tiny-GGUF", {
            "tiny-Q4_K_M.gguf": blob(1), "tiny-Q8_0.gguf": blob(2), "tiny-F16.gguf": blob(3),
            "mmproj-tiny-F16.gguf": blob(4, 1000), "README.md": "# tiny\n",
            "generation_config.json": '{"temperature": 0.2, "top_p": 0.9, "do_sample": true}',
        })
        h.add_repo("omni/split-GGUF", {p.name: p for p in tiny_split})  # real parts, as gguf-split writes
        h.add_repo("omni/tiny-hf", {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors": blob(7),
                                    "pytorch_model.bin": blob(8), "README.md": "x"})
        yield h


def cfg(hub_url: str, cache: Path, offline: bool = False) -> HubConfig:
    return HubConfig(endpoint=hub_url, cache_dir=cache, token=None, is_offline=offline)


def test_pull_by_tag_and_by_default_into_the_shared_cache_layout(hub: StandInHub, tmp_path: Path) -> None:
    seen: list[Progress] = []
    got = pull(parse_ref("omni/tiny-GGUF:q8_0"), seen.append, cfg(hub.url, tmp_path))
    assert got.model.name == "tiny-Q8_0.gguf" and got.model.read_bytes() == blob(2)
    assert got.model.is_symlink() and got.model.resolve().parent.name == "blobs"
    assert got.mmproj is not None and got.mmproj.read_bytes() == blob(4, 1000)
    assert got.sampling == {"temp": "0.2", "top-p": "0.9"}
    assert got.name == "omni/tiny-GGUF:Q8_0" and got.backend == "llama_cpp"
    repo = tmp_path / "models--omni--tiny-GGUF"
    assert (repo / "refs" / "main").read_text() == hub.repos["omni/tiny-GGUF"].commit
    assert seen[-1].done == seen[-1].total == BIG + 1000 + len(hub.repos["omni/tiny-GGUF"].files[
        "generation_config.json"].data)
    assert "tiny-Q4_K_M.gguf" not in hub.served  # only the chosen files came

    default = pull(parse_ref("omni/tiny-GGUF"), None, cfg(hub.url, tmp_path))
    assert default.model.name == "tiny-Q4_K_M.gguf" and default.tag == "Q4_K_M"
    served = dict(hub.served)
    pull(parse_ref("omni/tiny-GGUF"), None, cfg(hub.url, tmp_path))
    assert hub.served == served  # already complete: nothing downloaded again


def test_split_comes_whole_and_safetensors_repo_is_torch(hub: StandInHub, tiny_split: list[Path],
                                                        tmp_path: Path) -> None:
    split = pull(parse_ref("omni/split-GGUF"), None, cfg(hub.url, tmp_path))
    assert split.model.name == "tiny-split-Q8_0-00001-of-00003.gguf"
    assert all((split.snapshot / part.name).read_bytes() == part.read_bytes() for part in tiny_split)
    assert len(tiny_split) == 3  # (a router serves a chat from it: tests/hub/test_router_hub.py)
    hf = pull(parse_ref("omni/tiny-hf"), None, cfg(hub.url, tmp_path))
    assert hf.backend == "torch" and hf.model == hf.snapshot
    names = sorted(p.name for p in hf.snapshot.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]


def test_unknown_repo_and_tag_are_404_listing_the_tags(hub: StandInHub, tmp_path: Path) -> None:
    with pytest.raises(HubError) as e:
        pull(parse_ref("omni/tiny-GGUF:Q2_K"), None, cfg(hub.url, tmp_path))
    assert e.value.status == 404 and e.value.tags == ("F16", "Q4_K_M", "Q8_0")
    assert "tags: F16, Q4_K_M, Q8_0" in str(e.value)
    with pytest.raises(HubError, match="no repo 'omni/nope'") as e:
        pull(parse_ref("omni/nope"), None, cfg(hub.url, tmp_path))
    assert e.value.status == 404 and not e.value.is_transient


def test_hub_down_is_transient_and_the_cache_serves_offline(hub: StandInHub, tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(HubError, match="cannot reach the hub") as e:
        pull(parse_ref("omni/tiny-GGUF"), None, cfg(down, tmp_path))
    assert e.value.status == 503 and e.value.is_transient
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):
        pull(parse_ref("omni/tiny-GGUF"), None, cfg(hub.url, tmp_path, offline=True))
    first = pull(parse_ref("omni/tiny-GGUF"), None, cfg(hub.url, tmp_path))
    n = len(hub.requests)
    offline = pull(parse_ref("omni/tiny-GGUF"), None, cfg(hub.url, tmp_path, offline=True))
    assert offline.model == first.model and len(hub.requests) == n  # the hub was not asked
    assert pull(parse_ref("omni/tiny-GGUF"), None, cfg(down, tmp_path)).model == first.model
    # from the environment, as huggingface_hub reads it
    env = HubConfig.from_env({"HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1",
                              "HF_ENDPOINT": hub.url + "/"})
    assert (env.cache_dir, env.is_offline, env.endpoint) == (tmp_path / "home" / "hub", True, hub.url)
    assert HubConfig.from_env({"HF_HUB_CACHE": str(tmp_path), "HF_TOKEN": "t"}).cache_dir == tmp_path


def test_a_download_cut_halfway_resumes_where_it_stopped(hub: StandInHub, tmp_path: Path) -> None:
    hub.cut_after(128 * 1024)
    with pytest.raises(HubError, match="interrupted at 131072 of 307200 bytes") as e:
        pull(parse_ref("omni/tiny-GGUF:F16"), None, cfg(hub.url, tmp_path))
    assert e.value.is_transient
    blobs = tmp_path / "models--omni--tiny-GGUF" / "blobs"
    assert [p.name.endswith(".incomplete") for p in blobs.iterdir()] == [True]  # only the partial file
    assert not (tmp_path / "models--omni--tiny-GGUF" / "snapshots").exists()  # nothing to load
    hub.cut_after(None)
    got = pull(parse_ref("omni/tiny-GGUF:F16"), None, cfg(hub.url, tmp_path))
    assert hub.ranges == ["bytes=131072-"] and got.model.read_bytes() == blob(3)


def test_a_corrupt_file_is_refused_and_never_linked(hub: StandInHub, tmp_path: Path) -> None:
    hub.corrupt("tiny-F16.gguf")
    with pytest.raises(HubError, match="is not the hub's") as e:
        pull(parse_ref("omni/tiny-GGUF:F16"), None, cfg(hub.url, tmp_path))
    assert e.value.status == 502
    folder = tmp_path / "models--omni--tiny-GGUF"
    assert not list((folder / "blobs").iterdir()) and not (folder / "snapshots").exists()


def test_a_full_disk_names_the_folder_and_the_bytes(hub: StandInHub, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    Usage = namedtuple("Usage", "total used free")  # a stand-in for a full disk
    monkeypatch.setattr("router.hub.download.shutil.disk_usage",
                        lambda path: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(HubError) as e:
        pull(parse_ref("omni/tiny-GGUF:F16"), None, cfg(hub.url, tmp_path))
    blobs = tmp_path / "models--omni--tiny-GGUF" / "blobs"
    assert e.value.status == 507 and str(e.value) == (
        f"not enough disk space in {blobs}: {BIG} bytes needed, 1000 free")


def test_two_asks_share_one_download_and_see_its_progress(hub: StandInHub, tmp_path: Path) -> None:
    pulls = Pulls(lambda: cfg(hub.url, tmp_path))
    hub.hold_after(64 * 1024)
    seen: list[list[Progress]] = [[], []]

    async def both() -> list[Path]:
        ref = parse_ref("omni/tiny-GGUF:Q4_K_M")
        tasks = [asyncio.create_task(pulls.fetch(ref, seen[i].append)) for i in (0, 1)]
        await asyncio.to_thread(wait_until, lambda: hub.bytes_served("tiny-Q4_K_M.gguf") >= 64 * 1024,
                                10, what="the first 64 KiB")
        await asyncio.to_thread(wait_until, lambda: seen[0] and seen[1], 10, what="progress")
        assert list(pulls.in_flight()) == ["omni/tiny-GGUF:Q4_K_M"]
        hub.release()
        return [p.model for p in await asyncio.gather(*tasks)]

    a, b = asyncio.run(both())
    assert a == b and hub.served["tiny-Q4_K_M.gguf"] == BIG  # one download
    assert seen[0][-1].done == seen[0][-1].total and seen[1][-1].done == seen[1][-1].total
    assert not pulls.in_flight() and os.path.exists(a)
