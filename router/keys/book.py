"""The keys' state, one owner: the keyring in force, each key's limits, the usage counts.

The keyring is replaced whole on a reload (`prepare_reload` parses the file off the event loop
and raises before anything changes; the returned `install` swaps it in). A request holds the
`Key` it came with, so a reload never touches a request already running (its stream goes on);
a key whose limits did not change keeps its buckets and gate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from router.keys.keyfile import Key, KeyFileError, Keyring
from router.keys.limits import KeyLimits, limits_key
from router.keys.usage import KeyUsage, json_of
from worker.protocol.errors import APIError

log = logging.getLogger("omni.router.keys")


class KeyBook:
    def __init__(self, keyring: Keyring, source: Callable[[], Keyring] | None = None) -> None:
        self.keyring = Keyring()
        self.source = source
        self.usage = KeyUsage()
        self._limits: dict[str, tuple[object, KeyLimits]] = {}
        self.install(keyring)

    def install(self, keyring: Keyring) -> None:
        old = self._limits
        self._limits = {}
        for k in keyring.keys:
            if k.rpm or k.tpm or k.concurrency:
                was = old.get(k.name)
                shape = limits_key(k)
                self._limits[k.name] = (
                    was if was is not None and was[0] == shape else (shape, KeyLimits.of(k))
                )
        self.keyring = keyring
        if keyring.is_enabled:
            log.info(
                "keys: %d (%s)",
                len(keyring.keys),
                ", ".join(f"{k.name}: {k.role.value}" for k in keyring.keys),
            )

    async def prepare_reload(self) -> Callable[[], None]:
        """Parse the keys file again; an APIError (400) and nothing changed if it is broken."""
        source = self.source
        if source is None:
            return lambda: None
        try:
            ring = await asyncio.to_thread(source)
        except KeyFileError as e:
            log.error("keys file reload rejected, running keys unchanged: %s", e)
            raise APIError(
                f"keys file reload rejected, nothing changed: {e}", code="invalid_keys_file"
            ) from None
        return lambda: self.install(ring)

    def limits(self, key: Key) -> KeyLimits | None:
        entry = self._limits.get(key.name)
        return entry[1] if entry is not None else None

    def record(self, key: str, model: str, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """A request of `key` ended: count it, and take its tokens from the key's tpm bucket."""
        self.usage.record(key, model, prompt_tokens, completion_tokens)
        entry = self._limits.get(key)
        if entry is not None:
            entry[1].spend_tokens(time.monotonic(), (prompt_tokens or 0) + (completion_tokens or 0))

    def usage_json(self) -> dict[str, Any]:
        live: dict[str, dict[str, Any]] = {}
        for k in self.keyring.keys:
            lim = self.limits(k)
            gate = lim.gate if lim is not None else None
            live[k.name] = {
                "role": k.role.value,
                "models_allowed": list(k.models) or ["*"],
                "limits": {"rpm": k.rpm, "tpm": k.tpm, "concurrency": k.concurrency},
                "active": gate.active if gate else None,
                "waiting": gate.num_waiting if gate else None,
            }
        return json_of(self.usage, live)
