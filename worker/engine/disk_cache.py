"""The disk tier of the prompt cache (`--cache-dir`, `--cache-disk`): KV states that outlive the
process, so that a model evicted, put to sleep, reloaded or restarted finds its long prompts again.

Files. One entry per file, `<fingerprint[:16]>-<key>.kv` in the model's cache folder:
MAGIC, a little-endian u32 header length, the JSON header (fingerprint, tokens, rows, sizes),
the backend's `seq_state_get` bytes, the saved logits (float32, maybe none), then a u32 CRC-32 of
everything before it. A file is written under a name of its writer's own (`.NAME.PID-TID.tmp`,
O_EXCL) and renamed into place, so a reader sees a whole file or none and two workers of one
model never write into each other's files (both may write the same entry: the last rename wins,
and both are whole). A file that is truncated, fails its checksum or has a header of another
format is skipped with a log line and deleted; a file of another fingerprint is left alone (it
may be another worker's, with other flags) but counts against the budget.

Fingerprint. Everything that changes the KV values: the model file's (or HF folder files')
size, mtime and a SHA-256 of its first MiB, the backend and its version, and the KV-relevant
settings the worker passes (KV types, flash attention, ubatch size, dtype, device, GPU layers).
A changed model file at the same path gets another fingerprint: nothing of the old one is used.

Budget. `limit_bytes` is the folder's size; before a write the writer deletes the least recently
used `.kv` files (by mtime; a read touches its file) until the new one fits. The scan is of the
folder, not of this process's index, so two workers keep one budget.

Threads. `best` runs on the engine thread; `read` on the engine's loader thread; writes on this
module's writer thread (`put` only queues them). The index is shared under a lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.backends import BackendOptions
from worker.engine.metrics import WorkerMetrics
from worker.engine.policy import Rows, common_prefix_len, reusable
from worker.engine.prompt_cache import CachedPrompt

log = logging.getLogger("omni.worker.disk_cache")

MAGIC = b"OMNIKV1\n"
FORMAT = 1
_U32 = struct.Struct("<I")
_HEAD_BYTES = 1 << 20  # of the model file, hashed into the fingerprint
_TMP = re.compile(r"^\..+\.(\d+)-\d+\.tmp$")
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)$", re.IGNORECASE)


def parse_size(raw: str) -> int:
    """`512M`, `8G`, `1.5GiB`, `4096` (bytes) -> bytes; K/M/G/T are powers of 1024."""
    m = _SIZE_RE.match(raw.strip())
    if m is None:
        raise ValueError(f"{raw!r} is not a size like 512M, 8G or a number of bytes")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


def model_identity(model_path: str) -> list[list[object]]:
    """(name, size, mtime_ns, SHA-256 of the first MiB) of the model file, or of each file of a folder."""
    p = Path(model_path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    out: list[list[object]] = []
    for f in files:
        st = f.stat()
        with f.open("rb") as fh:
            head = fh.read(_HEAD_BYTES)
        out.append([f.name, st.st_size, st.st_mtime_ns, hashlib.sha256(head).hexdigest()])
    return out


def kv_settings(kind: str, options: BackendOptions, media_piece: int = 0) -> dict[str, object]:
    """The settings of `options` that change KV values (not the context size: a state fits or not),
    with the backend and its version, and the engine's --media-piece (an image's rows go in
    pieces of that many: other pieces, other kernels, other KV)."""
    package = "llama_cpp_python" if kind == "llama_cpp" else "torch"
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    keys: tuple[str, ...] = ("n_ubatch", "kv_unified", "embedding", "pooling")
    keys += ("n_gpu_layers", "cache_type_k", "cache_type_v", "flash_attn", "repack") if kind == "llama_cpp" \
        else ("device", "dtype", "compile")
    return {"backend": kind, "version": version, "media_piece": media_piece,
            **{k: getattr(options, k) for k in keys}}


def fingerprint(model_path: str, settings: Mapping[str, object]) -> str:
    """What a cached KV state is valid for: the model's identity and the KV-relevant settings."""
    blob = json.dumps({"format": FORMAT, "model": model_identity(model_path), "settings": settings},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class DiskEntry:
    path: Path
    tokens: tuple[int, ...]
    rows: Rows
    n_bytes: int


class DiskCacheError(ValueError):
    """A cache file that must not be loaded (damaged, truncated, of another format)."""


def entry_name(fp: str, tokens: Sequence[int], rows: Rows) -> str:
    key = hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes() + repr(rows).encode()).hexdigest()
    return f"{fp[:16]}-{key[:24]}.kv"


def write_file(path: Path, fp: str, prompt: CachedPrompt) -> int:
    """Write an entry atomically (a writer-own temp file, then rename); the bytes written."""
    logits = b"" if prompt.logits is None else np.ascontiguousarray(prompt.logits, dtype=np.float32).tobytes()
    header = json.dumps({"format": FORMAT, "fingerprint": fp, "tokens": list(prompt.tokens),
                         "rows": list(prompt.rows), "n_state": len(prompt.state),
                         "n_logits": len(logits) // 4}).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            crc = 0
            for part in (MAGIC, _U32.pack(len(header)), header, prompt.state, logits):
                f.write(part)
                crc = zlib.crc32(part, crc)
            f.write(_U32.pack(crc))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return len(MAGIC) + 8 + len(header) + len(prompt.state) + len(logits)


def _parse_header(data: bytes, path: Path) -> tuple[dict[str, object], int]:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise DiskCacheError(f"{path.name}: not a prompt-cache file")
    (n,) = _U32.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + 4
    if len(data) < start + n:
        raise DiskCacheError(f"{path.name}: truncated header")
    try:
        header = json.loads(data[start : start + n])
    except ValueError:
        raise DiskCacheError(f"{path.name}: damaged header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DiskCacheError(f"{path.name}: another file format")
    return header, start + n


def read_header(path: Path) -> dict[str, object]:
    """The header alone (indexing: the payload is checked when the entry is loaded)."""
    with path.open("rb") as f:
        head = f.read(64 << 10)
        if len(head) >= len(MAGIC) + 4:
            (n,) = _U32.unpack_from(head, len(MAGIC))
            if len(MAGIC) + 4 + n > len(head):
                head += f.read(len(MAGIC) + 4 + n - len(head))
    return _parse_header(head, path)[0]


def read_file(path: Path, fp: str) -> CachedPrompt:
    """A whole entry, checked (CRC-32, sizes, fingerprint); DiskCacheError if it must not be used."""
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 8:
        raise DiskCacheError(f"{path.name}: truncated")
    (crc,) = _U32.unpack_from(data, len(data) - 4)
    if zlib.crc32(memoryview(data)[:-4]) != crc:
        raise DiskCacheError(f"{path.name}: checksum mismatch (damaged or truncated)")
    header, start = _parse_header(data, path)
    try:
        n_state, n_logits = int(header["n_state"]), int(header["n_logits"])  # type: ignore[call-overload]  # checked by int()
        tokens = tuple(int(t) for t in header["tokens"])  # type: ignore[attr-defined]  # a JSON list
        n_rows, row_class = (int(x) for x in header["rows"])  # type: ignore[attr-defined]  # a JSON pair
    except (KeyError, TypeError, ValueError):
        raise DiskCacheError(f"{path.name}: damaged header") from None
    if header.get("fingerprint") != fp:
        raise DiskCacheError(f"{path.name}: KV state of another model or settings")
    if start + n_state + 4 * n_logits + 4 != len(data):
        raise DiskCacheError(f"{path.name}: sizes do not add up")
    state = bytearray(memoryview(data)[start : start + n_state])
    logits = None
    if n_logits:
        logits = np.frombuffer(data, dtype=np.float32, count=n_logits, offset=start + n_state).copy()
    return CachedPrompt(tokens, state, (n_rows, row_class), logits)


class DiskCache:
    def __init__(
        self, root: Path, limit_bytes: int, fp: str, metrics: WorkerMetrics, decode_class: int
    ) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.fingerprint = fp
        self.decode_class = decode_class
        self._metrics = metrics
        self._lock = threading.Lock()  # the index: engine, loader and writer threads
        self._entries: dict[str, DiskEntry] = {}  # file name -> entry of our fingerprint
        self._jobs: queue.SimpleQueue[CachedPrompt | None] = queue.SimpleQueue()
        self._pending = 0  # queued or being written (under _cv)
        self._cv = threading.Condition()
        root.mkdir(parents=True, exist_ok=True)
        self._index()
        self._writer = threading.Thread(target=self._write_loop, name="disk-cache-writer", daemon=True)
        self._writer.start()

    # -- index ---------------------------------------------------------------------------------
    def _index(self) -> None:
        """Read every entry's header; drop what is damaged and temp files of writers that are gone."""
        t0 = time.monotonic()
        n_foreign = 0
        for f in list(self.root.iterdir()):
            m = _TMP.match(f.name)
            if m is not None:
                if not _pid_alive(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        f.unlink()
                continue
            if f.suffix != ".kv":
                continue
            if not f.name.startswith(self.fingerprint[:16]):
                n_foreign += 1
                continue
            try:
                h = read_header(f)
                tokens = tuple(int(t) for t in h["tokens"])  # type: ignore[attr-defined]  # a JSON list
                n_rows, row_class = (int(x) for x in h["rows"])  # type: ignore[attr-defined]  # a JSON pair
                if h.get("fingerprint") != self.fingerprint:
                    n_foreign += 1
                    continue
                self._entries[f.name] = DiskEntry(f, tokens, (n_rows, row_class), f.stat().st_size)
            except (OSError, DiskCacheError, KeyError, TypeError, ValueError) as e:
                self._discard(f, str(e))
        self._publish_size()
        log.info(
            "prompt cache on disk: %d entries (%.1f MiB) in %s, %d of other models or settings; %.0f ms",
            len(self._entries), self.n_bytes() / 2**20, self.root, n_foreign, (time.monotonic() - t0) * 1e3,
        )

    def __len__(self) -> int:
        return len(self._entries)

    def n_bytes(self) -> int:
        """The folder's `.kv` files (every fingerprint's: one budget)."""
        return sum(size for _, size, _ in _scan(self.root))

    def best(self, prompt: Sequence[int], wanted: Rows, *, any_class: bool) -> tuple[DiskEntry | None, int]:
        """Engine thread: the entry whose rows the prompt may reuse most, and how many (as PromptCache)."""
        best, best_n = None, 0
        prompt = tuple(prompt)  # the entries' type: compared without a copy each
        with self._lock:
            entries = list(self._entries.values())
        for e in entries:
            n = common_prefix_len(e.tokens, prompt)
            if not any_class:
                n = reusable(n, e.rows, wanted, self.decode_class)
            if n > best_n:
                best, best_n = e, n
        return best, best_n

    def read(self, entry: DiskEntry) -> CachedPrompt | None:
        """Load an entry (any thread); None, logged, if it is gone or must not be used."""
        try:
            prompt = read_file(entry.path, self.fingerprint)
        except FileNotFoundError:
            self._forget(entry.path.name)  # another worker's budget took it
            return None
        except (OSError, DiskCacheError) as e:
            self._discard(entry.path, str(e))
            return None
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # most recently used
        self._metrics.prompt_cache_disk_hits.inc()
        return prompt

    def _discard(self, path: Path, why: str) -> None:
        log.warning("prompt cache on disk: skipping %s: %s (deleted)", path.name, why)
        self._forget(path.name)
        with contextlib.suppress(OSError):
            path.unlink()

    def _forget(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    # -- writes --------------------------------------------------------------------------------
    def put(self, prompts: Iterable[CachedPrompt]) -> None:
        """Queue entries for the writer thread (any thread; the states must not change after)."""
        for p in prompts:
            with self._cv:
                self._pending += 1
            self._jobs.put(p)

    def wait_written(self, timeout: float) -> bool:
        """Wait until everything queued is written (True) or `timeout` passed (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._jobs.put(None)

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._write(job)
            except Exception:
                log.exception("prompt cache on disk: write failed")
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _write(self, prompt: CachedPrompt) -> None:
        name = entry_name(self.fingerprint, prompt.tokens, prompt.rows)
        path = self.root / name
        if path.exists():
            with contextlib.suppress(OSError):
                os.utime(path)  # already there (read from it, or written by another worker)
            return
        size = prompt.n_bytes + 512 + 12 * len(prompt.tokens)  # a bound on the header
        if size > self.limit_bytes or not self._make_room(size):
            log.info("prompt cache on disk: %d tokens (%.1f MiB) do not fit in the budget",
                     len(prompt.tokens), size / 2**20)
            return
        n = write_file(path, self.fingerprint, prompt)
        with self._lock:
            self._entries[name] = DiskEntry(path, prompt.tokens, prompt.rows, n)
        self._metrics.prompt_cache_disk_writes.inc()
        self._metrics.prompt_cache_disk_bytes.inc(n)
        self._publish_size()
        log.info("prompt cache on disk: wrote %d tokens (%.1f MiB) to %s", len(prompt.tokens), n / 2**20,
                 name)

    def _make_room(self, size: int) -> bool:
        """Delete the least recently used files until `size` more bytes fit in the budget."""
        files = sorted(_scan(self.root), key=lambda f: f[2])  # oldest first
        total = sum(s for _, s, _ in files)
        for path, s, _ in files:
            if total + size <= self.limit_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                log.info("prompt cache on disk: evicted %s (%.1f MiB, least recently used)", path.name,
                         s / 2**20)
            self._forget(path.name)
            total -= s
        return total + size <= self.limit_bytes

    def _publish_size(self) -> None:
        self._metrics.prompt_cache_disk_size.set(self.n_bytes())


def _scan(root: Path) -> list[tuple[Path, int, float]]:
    """(path, size, mtime) of the folder's `.kv` files."""
    out = []
    with contextlib.suppress(OSError), os.scandir(root) as it:
        for d in it:
            if d.name.endswith(".kv") and not d.name.startswith("."):
                with contextlib.suppress(OSError):
                    st = d.stat()
                    out.append((Path(d.path), st.st_size, st.st_mtime))
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
