"""The durable store of responses and conversations: one SQLite file (stdlib `sqlite3`).

Responses keep their response object and their own input items; `previous_response_id` is
replayed by walking the chain back. Conversations keep their items in order. Both are bounded
by entry count and age (each kind counted on its own), pruned on every write; an expired entry
is invisible to reads at once. In the router every call runs on one thread of the store's own
(`call()`), so the event loop never blocks on the disk and calls never interleave.

Each response and conversation belongs to the key that created it (`owner`, the key's name from
the keys file). Every call that reads, continues or deletes one is given the caller's `Owner`
explicitly (the request's key lives in a ContextVar, which does not reach this thread): another
user key finds nothing, exactly as for an id that does not exist. A file from before owners gets
the column on open; its rows have none, so only admin keys (and a router without keys) see them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("omni.router.responses")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, status TEXT NOT NULL,
    previous_response_id TEXT, body TEXT NOT NULL, input TEXT NOT NULL, owner TEXT);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, metadata TEXT NOT NULL, owner TEXT);
CREATE INDEX IF NOT EXISTS conversations_created ON conversations (created_at);
CREATE TABLE IF NOT EXISTS conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id TEXT NOT NULL, item_id TEXT NOT NULL,
    item TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS conversation_items_conv ON conversation_items (conversation_id, seq);
"""
# files written before owners: (table, the statement that adds its column)
_OWNER_COLUMNS = (
    ("responses", "ALTER TABLE responses ADD COLUMN owner TEXT"),
    ("conversations", "ALTER TABLE conversations ADD COLUMN owner TEXT"),
)


@dataclass(frozen=True)
class Owner:
    """Whose stored responses and conversations a call is for. `name` is written on what it
    creates (None: nobody's); `sees_all` (admin keys, a router without keys) reads every row,
    otherwise only the rows owned by `name` (a row without an owner is then not there)."""

    name: str | None = None
    sees_all: bool = True

    @property
    def params(self) -> tuple[int, str | None]:
        """The parameters of `(? OR owner = ?)`, the rows it may see (the SQL twin of can_see)."""
        return int(self.sees_all), self.name

    def can_see(self, owner: str | None) -> bool:
        return self.sees_all or (owner is not None and owner == self.name)


ANYONE = Owner()  # no keys, or work not done for a request: every row, and new ones are nobody's


class ChainBroken(LookupError):
    """A response in a `previous_response_id` chain is gone (deleted, expired or never stored)."""


class NotContinuable(ValueError):
    """`previous_response_id` names a response with n > 1 samples: which one continues is the
    client's choice, so the chain does not pick one."""


class Store:
    def __init__(self, path: Path, *, max_entries: int, ttl_s: float) -> None:
        self.path = path
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="responses-store")
        self._db: sqlite3.Connection | None = None
        self.num_recovered = 0

    @property
    def is_enabled(self) -> bool:
        return self.max_entries > 0

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._executor.submit(shut).result()
        self._executor.shutdown()

    # ---- everything below runs on the store's thread

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # autocommit (`with db` for transactions); one thread at a time uses it: the store's
            # own in the router, the caller's in unit tests
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            for table, add_column in _OWNER_COLUMNS:
                has_owner = db.execute("SELECT 1 FROM pragma_table_info(?) WHERE name = 'owner'", (table,))
                if has_owner.fetchone() is None:
                    db.execute(add_column)
            self._db = db
            self.num_recovered = self._recover()
        return self._db

    def _cutoff(self) -> int:
        """Entries created before this are expired; `ttl_s` 0 means no expiry."""
        return int(time.time() - self.ttl_s) if self.ttl_s > 0 else -(2**62)

    def open(self) -> int:
        """Open (the first call of any kind does: a router that never uses the store never
        creates its file); returns how many unfinished responses `_recover` failed."""
        self._conn()
        return self.num_recovered

    def _recover(self) -> int:
        """Responses left queued or in progress by a router that went away fail now."""
        db = self._conn()
        self._prune()
        rows = db.execute(
            "SELECT id, body FROM responses WHERE status IN ('queued', 'in_progress')"
        ).fetchall()
        for rid, body in rows:
            obj = json.loads(body)
            obj.update(status="failed", error={"code": "server_error", "message": "the router restarted"})
            db.execute(
                "UPDATE responses SET status = 'failed', body = ? WHERE id = ?", (json.dumps(obj), rid)
            )
        if rows:
            log.warning(
                "%d background responses left unfinished by the last router are failed now", len(rows)
            )
        return len(rows)

    def _prune(self) -> None:
        db = self._conn()
        cutoff = self._cutoff()
        with db:
            db.execute("DELETE FROM responses WHERE created_at < ?", (cutoff,))
            db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC, "
                "rowid DESC LIMIT -1 OFFSET ?)",
                (self.max_entries,),
            )
            db.execute("DELETE FROM conversations WHERE created_at < ?", (cutoff,))
            db.execute(
                "DELETE FROM conversations WHERE id IN "
                "(SELECT id FROM conversations ORDER BY created_at DESC, "
                "rowid DESC LIMIT -1 OFFSET ?)",
                (self.max_entries,),
            )
            db.execute(
                "DELETE FROM conversation_items WHERE conversation_id NOT IN (SELECT id FROM conversations)"
            )

    # responses

    def put_response(self, body: dict[str, Any], input_items: list[dict[str, Any]], owner: Owner) -> None:
        db = self._conn()
        is_new = db.execute("SELECT 1 FROM responses WHERE id = ?", (body["id"],)).fetchone() is None
        db.execute("INSERT OR REPLACE INTO responses "
                   "(id, created_at, status, previous_response_id, body, input, owner) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (body["id"], body["created_at"], body["status"], body.get("previous_response_id"),
                    json.dumps(body), json.dumps(input_items), owner.name))
        if is_new:
            self._prune()

    def get_response(self, rid: str, owner: Owner) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        row = self._conn().execute(
            "SELECT body, input FROM responses WHERE id = ? AND created_at >= ? AND (? OR owner = ?)",
            (rid, self._cutoff(), *owner.params),
        ).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete_response(self, rid: str, owner: Owner) -> bool:
        return self._conn().execute(
            "DELETE FROM responses WHERE id = ? AND (? OR owner = ?)", (rid, *owner.params)
        ).rowcount > 0

    def chain(self, rid: str, owner: Owner) -> list[dict[str, Any]]:
        """Input and output items of `rid` and every response before it, oldest first; each one
        must be visible to `owner` (ChainBroken otherwise, as for a deleted one)."""
        segments: list[list[dict[str, Any]]] = []
        cur: str | None = rid
        while cur is not None:
            found = self.get_response(cur, owner)
            if found is None:
                raise ChainBroken(cur)
            body, input_items = found
            if int(body.get("n") or 1) > 1:
                raise NotContinuable(cur)
            segments.append(input_items + body["output"])
            cur = body.get("previous_response_id")
        return [item for seg in reversed(segments) for item in seg]

    # conversations

    def put_conversation(self, cid: str, created_at: int, metadata: dict[str, str], owner: Owner) -> None:
        self._conn().execute(
            "INSERT INTO conversations (id, created_at, metadata, owner) VALUES (?, ?, ?, ?)",
            (cid, created_at, json.dumps(metadata), owner.name),
        )
        self._prune()

    def set_metadata(self, cid: str, metadata: dict[str, str], owner: Owner) -> bool:
        """Replace a conversation's metadata; its owner stays (an admin's edit does not take it)."""
        return self._conn().execute(
            "UPDATE conversations SET metadata = ? WHERE id = ? AND created_at >= ? AND (? OR owner = ?)",
            (json.dumps(metadata), cid, self._cutoff(), *owner.params),
        ).rowcount > 0

    def get_conversation(self, cid: str, owner: Owner) -> dict[str, Any] | None:
        row = (
            self._conn()
            .execute(
                "SELECT created_at, metadata FROM conversations "
                "WHERE id = ? AND created_at >= ? AND (? OR owner = ?)",
                (cid, self._cutoff(), *owner.params),
            )
            .fetchone()
        )
        if row is None:
            return None
        return {"id": cid, "object": "conversation", "created_at": row[0], "metadata": json.loads(row[1])}

    def delete_conversation(self, cid: str, owner: Owner) -> bool:
        db = self._conn()
        with db:
            if db.execute(
                "DELETE FROM conversations WHERE id = ? AND (? OR owner = ?)", (cid, *owner.params)
            ).rowcount == 0:
                return False
            db.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (cid,))
            return True

    def add_items(self, cid: str, items: list[dict[str, Any]]) -> None:
        db = self._conn()
        with db:
            db.executemany("INSERT INTO conversation_items (conversation_id, item_id, item) VALUES (?, ?, ?)",
                           [(cid, it["id"], json.dumps(it)) for it in items])

    def items(self, cid: str) -> list[dict[str, Any]]:
        rows = (
            self._conn()
            .execute("SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY seq", (cid,))
            .fetchall()
        )
        return [json.loads(r[0]) for r in rows]

    def delete_item(self, cid: str, item_id: str) -> bool:
        return (
            self._conn()
            .execute(
                "DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?", (cid, item_id)
            )
            .rowcount
            > 0
        )


def page(items: list[dict[str, Any]], *, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """One page of a list endpoint (`order` asc or desc, `after` an item id)."""
    ordered = items if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [it.get("id") for it in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
