"""Bring a repo's chosen files into the hub cache: list, choose, download, verify, link.

The cache is the one `huggingface_hub`, transformers and llama.cpp share
(`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`):
`models--ORG--REPO/blobs/<etag>`, `snapshots/<commit>/<file>` a relative link to its blob,
`refs/<revision>` the commit. The repo is listed with `huggingface_hub`'s `HfApi.model_info`
(`$HF_ENDPOINT`, `$HF_TOKEN` or the saved token), with each file's size and hash.

The bytes move here rather than through `hf_hub_download` because huggingface_hub 2.x downloads
into a file named per process and deletes it on any failure (a killed pull starts over) and
checks a file's size, not its hash. Here a file downloads into `blobs/<etag>.incomplete` under
the same lock file huggingface_hub takes (`.locks/models--ORG--REPO/<etag>.lock`, so a download
by either is never done twice at once), resumes from what is there with an HTTP Range request,
and becomes `blobs/<etag>` only once its SHA-256 (LFS files) or git blob id (small files)
matches what the hub listed: no partial or corrupt file is ever linked into a snapshot, so none
is ever loaded.

Failures are `HubError`s with an HTTP status: 404 (no such repo, revision, file or tag: the
message lists the tags there are), 503 (the hub cannot be reached, or answered 5xx: transient,
a later pull resumes), 507 (the disk is full: the folder and the bytes needed), 502 (a file
whose hash does not match: refused and deleted). With `HF_HUB_OFFLINE=1`, or when the hub cannot
be reached, a reference already in the cache is served from it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from router.hub.choice import GENERATION_CONFIG, Choice, ChoiceError, Ref, choose, tags_of

log = logging.getLogger("omni.router.hub")
CHUNK = 1 << 20
DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "ON", "YES", "TRUE"}
# generation_config.json keys -> omni-worker flags (the model's recommended sampling)
SAMPLING_KEYS = {"temperature": "temp", "top_p": "top-p", "top_k": "top-k", "min_p": "min-p",
                 "repetition_penalty": "repeat-penalty"}


class HubError(Exception):
    """A pull that failed; `status` is the HTTP status it maps to, `tags` what the repo offers."""

    def __init__(self, message: str, status: int, tags: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.tags = tags

    @property
    def is_transient(self) -> bool:
        """A later try may succeed (hub down, disk full, a corrupt download deleted)."""
        return self.status != 404


@dataclass(frozen=True)
class HubConfig:
    """Where the hub and the cache are, read from the environment as huggingface_hub reads it."""

    endpoint: str = DEFAULT_ENDPOINT
    cache_dir: Path = Path.home() / ".cache" / "huggingface" / "hub"
    token: str | None = None
    is_offline: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HubConfig:
        e = os.environ if env is None else env
        home = e.get("HF_HOME") or os.path.join(e.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
        cache = e.get("HF_HUB_CACHE") or e.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
        token = e.get("HF_TOKEN") or e.get("HUGGING_FACE_HUB_TOKEN") or _saved_token(home)
        offline = (e.get("HF_HUB_OFFLINE") or e.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE
        return cls((e.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
                   Path(os.path.expandvars(os.path.expanduser(cache))), token, offline)

    def repo_folder(self, repo: str) -> Path:
        return self.cache_dir / ("models--" + repo.replace("/", "--"))


def _saved_token(home: str) -> str | None:
    """The token `hf auth login` saved ($HF_HOME/token), as huggingface_hub finds it."""
    try:
        text = Path(os.path.expanduser(home), "token").read_text().strip()
    except OSError:
        return None
    return text or None


@dataclass(frozen=True)
class RemoteFile:
    size: int | None
    sha256: str | None = None  # LFS files
    blob_id: str | None = None  # the git blob id (small files)

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id or ""


@dataclass(frozen=True)
class Listing:
    commit: str
    files: Mapping[str, RemoteFile]
    is_cached: bool = False  # read from the cache (offline, or the hub unreachable)


@dataclass(frozen=True)
class Progress:
    """Bytes of this pull: `done` of `total` (every chosen file), `file` the one under way."""

    done: int
    total: int
    file: str
    file_done: int = 0  # of the file under way: its bytes here, its size and its hash (etag)
    file_total: int = 0
    digest: str = ""


@dataclass(frozen=True)
class Pulled:
    ref: Ref
    commit: str
    snapshot: Path
    backend: str  # llama_cpp | torch
    model: Path  # the GGUF (first part of a split one) or, torch, the snapshot folder
    mmproj: Path | None
    files: tuple[str, ...]
    total_bytes: int
    sampling: Mapping[str, str] = field(default_factory=dict)  # worker flag -> value
    tag: str | None = None
    layers: tuple[tuple[str, str, int], ...] = ()  # (file, its hash, its size), as the hub listed them

    @property
    def name(self) -> str:
        """How it is named when served: `org/repo:TAG` (llama.cpp's router names cache entries so)."""
        return f"{self.ref.repo}:{self.tag}" if self.tag else self.ref.repo


# --------------------------------------------------------------------------- listing


def list_remote(cfg: HubConfig, ref: Ref) -> Listing:
    """The repo's files at `ref.revision`, with sizes and hashes, from the hub's API."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi(endpoint=cfg.endpoint, token=cfg.token or False)
    try:
        info = api.model_info(ref.repo, revision=ref.revision, files_metadata=True, timeout=30)
    except RevisionNotFoundError:
        raise HubError(f"{ref.repo} has no revision {ref.revision!r} on {cfg.endpoint}", 404) from None
    except RepositoryNotFoundError:
        raise HubError(f"no repo {ref.repo!r} on {cfg.endpoint} (or it is private or gated: "
                       "set HF_TOKEN)", 404) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 0
        raise HubError(f"{cfg.endpoint} answered {status} for {ref.repo}: {_first_line(e)}",
                       503 if status >= 500 or status in (0, 408, 429) else 502) from None
    except Exception as e:  # connection refused, DNS, timeout: the hub is not there now
        raise HubError(f"cannot reach the hub at {cfg.endpoint}: {_first_line(e)} "
                       "(a later pull tries again)", 503) from None
    files = {s.rfilename: RemoteFile(s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
             for s in info.siblings or []}
    if not info.sha:
        raise HubError(f"{cfg.endpoint} listed {ref.repo} without its commit", 502)
    return Listing(info.sha, files)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def list_cached(cfg: HubConfig, ref: Ref) -> Listing | None:
    """The snapshot of `ref.revision` in the cache (files whose blobs are complete), or None."""
    folder = cfg.repo_folder(ref.repo)
    commit = ref.revision
    try:
        commit = (folder / "refs" / ref.revision).read_text().strip()
    except OSError:
        pass
    snap = folder / "snapshots" / commit
    if not snap.is_dir():
        return None
    files = {str(p.relative_to(snap)): RemoteFile(p.stat().st_size)
             for p in sorted(snap.rglob("*")) if p.is_file()}  # (a dangling link is no file)
    return Listing(commit, files, is_cached=True) if files else None


def _listing(cfg: HubConfig, ref: Ref) -> Listing:
    if cfg.is_offline:
        cached = list_cached(cfg, ref)
        if cached is None:
            raise HubError(f"{ref} is not in the hub cache ({cfg.cache_dir}) and HF_HUB_OFFLINE "
                           "is set: nothing can be downloaded", 503)
        return cached
    try:
        return list_remote(cfg, ref)
    except HubError as e:
        cached = list_cached(cfg, ref) if e.status == 503 else None
        if cached is None:
            raise
        log.warning("%s; serving %s from the cache (%s)", e, ref, cfg.cache_dir)
        return cached


# --------------------------------------------------------------------------- one file


def _url(cfg: HubConfig, repo: str, commit: str, name: str) -> str:
    return f"{cfg.endpoint}/{repo}/resolve/{commit}/{name}"


def _link(pointer: Path, blob: Path) -> None:
    pointer.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob, pointer.parent)
    tmp = pointer.with_name(pointer.name + ".link-tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, pointer)


def _digest(path: Path, remote: RemoteFile) -> tuple[str, str]:
    """(what the hub listed, what the file hashes to): SHA-256 for LFS, the git blob id otherwise."""
    if remote.sha256:
        h = hashlib.sha256()
        expected = remote.sha256
    else:
        h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
        expected = remote.blob_id or ""
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return expected, h.hexdigest()


def _check_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise HubError(f"not enough disk space in {folder}: {need} bytes needed, {free} free", 507)


def fetch_file(cfg: HubConfig, repo: str, commit: str, name: str, remote: RemoteFile,
               on_bytes: Callable[[int], None], client: httpx.Client) -> Path:
    """`snapshots/<commit>/<name>`, downloaded (or resumed) and verified first if its blob is not
    complete. `on_bytes(n)`: n more bytes are there (what a resume finds included)."""
    folder = cfg.repo_folder(repo)
    pointer = folder / "snapshots" / commit / name
    if not remote.etag:
        raise HubError(f"{cfg.endpoint} listed {repo}/{name} without a hash: it cannot be checked", 502)
    blob = folder / "blobs" / remote.etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    lock_path = cfg.cache_dir / ".locks" / folder.name / f"{remote.etag}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path)):  # another pull of this file (here or elsewhere) finishes first
        if not blob.is_file():
            _download(cfg, _url(cfg, repo, commit, name), blob, remote, name, on_bytes, client)
        else:
            on_bytes(blob.stat().st_size)
    _link(pointer, blob)
    return pointer


def _download(cfg: HubConfig, url: str, blob: Path, remote: RemoteFile, name: str,
              on_bytes: Callable[[int], None], client: httpx.Client) -> None:
    part = blob.with_name(blob.name + ".incomplete")
    have = part.stat().st_size if part.is_file() else 0
    if remote.size is not None and have > remote.size:
        part.unlink()
        have = 0
    if remote.size is not None:
        _check_space(blob.parent, remote.size - have)
    if have:
        log.info("%s: resuming at %d of %s bytes", name, have, remote.size)
        on_bytes(have)
    headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
    if cfg.token:
        headers["Authorization"] = f"Bearer {cfg.token}"
    try:
        with client.stream("GET", url, headers=headers) as r:
            if r.status_code == 404:
                raise HubError(f"{url}: not found on the hub", 404)
            if r.status_code >= 400:
                status = 503 if r.status_code >= 500 else 502
                raise HubError(f"{url}: the hub answered {r.status_code}", status)
            if have and r.status_code != 206:  # the range was ignored: start over
                on_bytes(-have)
                have = 0
            with part.open("ab" if have else "wb") as f:
                for chunk in r.iter_bytes():  # as they come: what is on disk is what was received
                    f.write(chunk)
                    f.flush()
                    on_bytes(len(chunk))
    except httpx.HTTPError as e:
        size = part.stat().st_size if part.is_file() else 0
        raise HubError(f"download of {name} interrupted at {size} of {remote.size} bytes "
                       f"({_first_line(e)}); a later pull resumes it", 503) from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise HubError(f"the disk filled up in {blob.parent} while downloading {name}: "
                           f"{remote.size} bytes needed", 507) from None
        raise
    expected, actual = _digest(part, remote)
    if actual != expected:
        part.unlink(missing_ok=True)
        raise HubError(f"{name}: its hash {actual} is not the hub's {expected}: refused (deleted; "
                       "a later pull downloads it again)", 502)
    os.replace(part, blob)


# --------------------------------------------------------------------------- a pull


def read_sampling(path: Path) -> dict[str, str]:
    """The recommended sampling a repo's generation_config.json states, as omni-worker flags."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, str] = {}
    for key, flag in SAMPLING_KEYS.items():
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[flag] = f"{value:g}"
    return out


def pull(ref: Ref, on_progress: Callable[[Progress], None] | None = None,
         cfg: HubConfig | None = None) -> Pulled:
    """Bring `ref`'s model into the cache (blocking: call it from a thread). Files already
    complete are not downloaded again; a partial one resumes."""
    cfg = cfg or HubConfig.from_env()
    listing = _listing(cfg, ref)
    try:
        choice = choose(ref, list(listing.files))
    except ChoiceError as e:
        if listing.is_cached:  # what is missing may be on the hub: say so
            why = "HF_HUB_OFFLINE is set" if cfg.is_offline else "it could not be reached"
            raise HubError(f"{e} in the cache (the hub was not asked: {why})", 503, e.tags) from None
        raise HubError(str(e), 404, e.tags or tuple(tags_of(list(listing.files)))) from None
    sizes = [listing.files[f].size or 0 for f in choice.files]
    total = sum(sizes)
    done = 0
    current, file_start = "", 0

    def on_bytes(n: int) -> None:  # every chunk: the caller thins them out (pulls.py, pull_cli.py)
        nonlocal done
        done += n
        if on_progress is not None:
            remote = listing.files.get(current)
            on_progress(Progress(done, total, current, done - file_start, remote.size or 0 if remote else 0,
                                 remote.etag if remote else ""))

    snapshot = cfg.repo_folder(ref.repo) / "snapshots" / listing.commit
    if not listing.is_cached:
        with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=60.0)) as client:
            for name in choice.files:
                current, file_start = name, done
                fetch_file(cfg, ref.repo, listing.commit, name, listing.files[name], on_bytes, client)
        _write_ref(cfg, ref, listing.commit)
    else:
        done = total
    if on_progress is not None and listing.is_cached:
        on_progress(Progress(total, total, current))
    layers = tuple((f, listing.files[f].etag, listing.files[f].size or 0) for f in choice.files)
    return replace(_pulled(ref, listing.commit, snapshot, choice, total), layers=layers)


def _write_ref(cfg: HubConfig, ref: Ref, commit: str) -> None:
    if ref.revision == commit:
        return
    path = cfg.repo_folder(ref.repo) / "refs" / ref.revision
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text().strip() != commit:
        path.write_text(commit)


def _pulled(ref: Ref, commit: str, snapshot: Path, choice: Choice, total: int) -> Pulled:
    model = snapshot / choice.model if choice.model else snapshot
    return Pulled(ref, commit, snapshot, choice.backend, model,
                  snapshot / choice.mmproj if choice.mmproj else None, choice.files, total,
                  read_sampling(snapshot / GENERATION_CONFIG), choice.tag)


def describe(p: Pulled) -> dict[str, Any]:
    """What a pull brought, for JSON answers and logs."""
    return {"model": p.name, "repo": p.ref.repo, "commit": p.commit, "backend": p.backend,
            "path": str(p.model), "mmproj": str(p.mmproj) if p.mmproj else None,
            "files": list(p.files), "bytes": p.total_bytes, "sampling": dict(p.sampling)}
