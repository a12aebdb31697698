"""The keys file (`--keys FILE`, TOML) -> a `Keyring` of frozen `Key`s; `add_key` appends one.

    [keys.alice]                       # the key's name: metrics, /keys/usage and the audit log
    sha256 = "9f86d0...0a08"           # hex SHA-256 of the key; the key itself is never stored
    role = "user"                      # admin (every route) | user (inference and listing)
    models = ["qwen*", "tiny-chat"]    # names or globs (fnmatch), of a model or an alias; default all
    rpm = 60                           # requests per minute (a token bucket: burst rpm, refill rpm/60 a s)
    tpm = 100000                       # tokens per minute (prompt + completion, from each answer's usage)
    concurrency = 4                    # requests at once; more wait in line ...
    queue = 64                         # ... up to this many (default 64), then 429

Every limit is optional (absent: none). A plain `key = "..."` is refused: the file holds hashes
only (`omni-router keys add` writes them). A key given with `--api-key` is an admin key named
`api-key` (`api-key-2`, ... for more).

`Keyring.identify(token)` hashes the token once and compares it with every key's hash in
constant time (`hmac.compare_digest`, no early exit), so neither which key matched nor how much
of a hash matched shows in the time taken.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import tomllib
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

DEFAULT_QUEUE = 64
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]*$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = ("sha256", "role", "models", "rpm", "tpm", "concurrency", "queue")
_LIMITS = ("rpm", "tpm", "concurrency", "queue")
KEY_PREFIX = "sk-omni-"


class KeyFileError(ValueError):
    """A bad keys file; the message names the file and the key path."""


class Role(StrEnum):
    ADMIN = "admin"
    USER = "user"


@dataclass(frozen=True)
class Key:
    name: str
    role: Role
    digest: bytes  # SHA-256 of the key
    models: tuple[str, ...] = ()  # names or globs; () = every model
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None
    queue: int = DEFAULT_QUEUE

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    def may_use(self, names: tuple[str, ...]) -> bool:
        """Whether a model known by `names` (its name, then its aliases) is one of this key's."""
        if not self.models:
            return True
        return any(fnmatchcase(n, pattern) for pattern in self.models for n in names)


@dataclass(frozen=True)
class Keyring:
    keys: tuple[Key, ...] = ()
    is_from_file: bool = False  # `--keys` given (an empty file still locks every route)

    @property
    def is_enabled(self) -> bool:
        """Whether the router asks for a key at all (`--api-key` or `--keys` given)."""
        return bool(self.keys) or self.is_from_file

    def identify(self, token: bytes) -> Key | None:
        if not token:
            return None
        digest = hashlib.sha256(token).digest()
        found: Key | None = None
        for key in self.keys:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def names(self) -> list[str]:
        return [k.name for k in self.keys]


def hash_key(plain: str) -> str:
    return hashlib.sha256(plain.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def api_keys(plain: list[str]) -> tuple[Key, ...]:
    """`--api-key` values: admin keys with every model, no limits."""
    return tuple(
        Key(
            name="api-key" if i == 0 else f"api-key-{i + 1}",
            role=Role.ADMIN,
            digest=hashlib.sha256(k.encode()).digest(),
        )
        for i, k in enumerate(plain)
    )


def load_keyring(path: Path | None, plain: list[str]) -> Keyring:
    """The keys of `--keys FILE` (if given) and of `--api-key`; KeyFileError if the file is bad."""
    keys = api_keys(plain)
    if path is not None:
        keys += load_keys(path)
    names = [k.name for k in keys]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise KeyFileError(
            f"{path}: key name {dup[0]!r} is used twice (--api-key keys are named api-key, ...)"
        )
    return Keyring(keys, is_from_file=path is not None)


def load_keys(path: Path) -> tuple[Key, ...]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the keys file: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise KeyFileError(f"{path}: not valid TOML: {e}") from None
    extra = sorted(set(data) - {"keys"})
    if extra:
        raise KeyFileError(f"{path}: unknown top-level key {extra[0]!r} (expected [keys.NAME] tables)")
    table = data.get("keys", {})
    if not isinstance(table, dict):
        raise KeyFileError(f"{path}: 'keys' must be a table of [keys.NAME] tables")
    return tuple(_parse_key(path, name, entry) for name, entry in table.items())


def _parse_key(path: Path, name: str, entry: Any) -> Key:
    where = f"{path}: keys.{name}"
    if not _NAME_RE.match(name):
        raise KeyFileError(f"{where}: a key name is letters, digits and . _ @ + -")
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where} must be a table")
    if "key" in entry:
        raise KeyFileError(
            f"{where}.key: the file holds no plain keys, only their sha256 "
            "(omni-router keys add NAME writes one)"
        )
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise KeyFileError(f"{where}.{unknown[0]}: unknown field (valid: {', '.join(_FIELDS)})")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not _HEX_RE.match(digest.lower()):
        raise KeyFileError(f"{where}.sha256: required, the key's SHA-256 as 64 hex digits")
    role = entry.get("role", "user")
    if role not in (Role.ADMIN.value, Role.USER.value):
        raise KeyFileError(f"{where}.role: {role!r} is not one of admin, user")
    models = entry.get("models", [])
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise KeyFileError(f"{where}.models: a list of model names or globs")
    limits: dict[str, int] = {}
    for field in _LIMITS:
        value = entry.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if field == "queue" else 1):
            raise KeyFileError(f"{where}.{field}: a whole number {'>= 0' if field == 'queue' else '>= 1'}")
        limits[field] = value
    return Key(
        name=name,
        role=Role(role),
        digest=bytes.fromhex(digest.lower()),
        models=tuple(models),
        rpm=limits.get("rpm"),
        tpm=limits.get("tpm"),
        concurrency=limits.get("concurrency"),
        queue=limits.get("queue", DEFAULT_QUEUE),
    )


def add_key(path: Path, name: str, role: Role, models: list[str], limits: dict[str, int | None]) -> str:
    """Append a new key to `path` (created if missing) and return it: the only time it is shown.
    The file is checked first, and again with the new entry, so a bad result is never written."""
    existing = load_keys(path) if path.exists() else ()
    if any(k.name == name for k in existing):
        raise KeyFileError(f"{path}: a key named {name!r} is already there")
    plain = new_key()
    lines = [f"[keys.{name}]", f'sha256 = "{hash_key(plain)}"', f'role = "{role.value}"']
    if models:
        lines.append(f"models = [{', '.join(json.dumps(m) for m in models)}]")
    lines += [f"{k} = {v}" for k, v in limits.items() if v is not None]
    old = path.read_text() if path.exists() else ""
    text = old + ("\n" if old and not old.endswith("\n") else "") + ("\n" if old.strip() else "")
    text += "\n".join(lines) + "\n"
    probe = path.with_name(path.name + ".new")
    probe.write_text(text)
    try:
        load_keys(probe)
        probe.chmod(0o600)
        probe.replace(path)
    finally:
        probe.unlink(missing_ok=True)
    return plain
