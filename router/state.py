"""The lifecycle state of one model, as shown on the wire (`/v1/models` `status.value`)."""

from __future__ import annotations

from enum import StrEnum


class ModelState(StrEnum):
    """Lifecycle of one model. Only the model's owner task (router.pool) writes it.

    Values follow llama.cpp's router (`unloaded`, `loading`, `loaded`, `sleeping`) plus ours.

        from       event                                   to
        UNLOADED   ensure_ready / load (startup, /models/load)  LOADING  (waits for a slot first)
        FAILED     ensure_ready / load (after backoff)     LOADING
        LOADING    /health 200                             READY
        LOADING    exit / start timeout / /health 500      FAILED    (exit code + log tail kept)
        LOADING    every waiter left before the spawn      UNLOADED
        LOADING    no slot can ever be had (all pinned)    UNLOADED  (waiters get a 503; not FAILED)
        READY      idle for ttl (worker can sleep)         SLEEPING  (POST /sleep)
        READY      idle for ttl (server without sleep)     STOPPING  (e.g. a `cmd` llama-server)
        SLEEPING   ensure_ready                            LOADING   (POST /wake, phase "waking";
                                                                      none if the /sleep failed)
        READY|SLEEPING  unload / evicted (no request in flight)  STOPPING
        LOADING    unload                                  STOPPING
        STOPPING   process reaped                          UNLOADED
        any        unexpected exit                         FAILED

    A remote upstream is READY forever. A slot under `--models-max` is held from its grant
    until the process is reaped: it is given back on entering UNLOADED or FAILED.
    "Can sleep" = the server's /health reports `is_sleeping` (our worker's contract).
    """

    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "loaded"
    SLEEPING = "sleeping"
    STOPPING = "stopping"
    FAILED = "failed"

    @property
    def has_process(self) -> bool:
        return self in (ModelState.LOADING, ModelState.READY, ModelState.SLEEPING, ModelState.STOPPING)
