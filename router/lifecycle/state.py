"""The lifecycle of one model: its `Phase` (the owner's state) and the `ModelState` shown on the wire."""

from __future__ import annotations

from enum import StrEnum


class ModelState(StrEnum):
    """The status value on the wire (`/v1/models` `status.value`, `/models/sse`).

    Values follow llama.cpp's router (`unloaded`, `loading`, `loaded`, `sleeping`) plus ours
    (`stopping`, `failed`). Each `Phase` maps onto one of them.
    """

    UNLOADED = "unloaded"
    DOWNLOADING = "downloading"  # an `hf-repo` model's files on their way into the hub cache (QUEUED)
    LOADING = "loading"
    READY = "loaded"
    SLEEPING = "sleeping"
    STOPPING = "stopping"
    FAILED = "failed"


class Phase(StrEnum):
    """Lifecycle of one model. Only the model's owner task (`router.lifecycle.model.ModelHandle`) writes it;
    effects (estimate, acquire a slot, spawn, readiness, sleep, wake, stop, exit, memory samples)
    report back with messages (`router.lifecycle.messages`: `Estimated`, `Granted`, `Refused`, `Spawned`,
    `Progress`, `Ready`, `LoadFailed`, `SleepDone`, `Exited`, `Measured`).

        from                    event                                  to
        UNLOADED|FAILED         ensure_ready / load (FAILED: once its  QUEUED     (asks Slots for a slot
                                  backoff is over)                                and room in the budgets)
        QUEUED (hf-repo, files  Fetched (router/hub: in the hub cache) QUEUED     (estimates, as any other;
          not yet fetched:                                                        shown `downloading`
          `downloading`)                                                          until then)
        QUEUED (downloading)    FetchFailed                            FAILED     (404: permanent; hub
                                                                                  down, disk full: not)
        QUEUED                  Estimated (the need, from a thread)    QUEUED     (waits in Slots' FIFO)
        QUEUED                  Granted                                SPAWNING
        QUEUED                  Refused (can never fit)                UNLOADED   (waiters: 503 with figures)
        QUEUED                  unload / every waiter left             UNLOADED
        QUEUED                  preset changed (reload)                QUEUED     (again, with the new need)
        SPAWNING                Spawned                                STARTING
        SPAWNING                LoadFailed (spawn error)               FAILED
        SPAWNING                unload                                 SPAWNING_THEN_STOP (a process may
                                                                                  be on its way:
                                                                                  never orphan it)
        SPAWNING_THEN_STOP      Spawned                                STOPPING
        SPAWNING_THEN_STOP      LoadFailed                             UNLOADED
        STARTING|WAKING         Progress                               (same)     (progress shown)
        STARTING                Ready                                  READY      (STOPPING if a reload
                                                                                  changed it: requests wait)
        STARTING|WAKING         LoadFailed (timeout, /health 500)      STOPPING_AFTER_FAILURE
        STARTING|WAKING         unload                                 STOPPING
        READY                   drain (Slots: a queued model waits)    DRAINING
        READY                   preset changed or removed (reload)     DRAINING
        DRAINING                drain off (queue empty, no reload)     READY      (waiters admitted)
        DRAINING                last request done, reload pending      STOPPING
        FALLING_ASLEEP|SLEEPING preset changed or removed (reload)     STOPPING
        UNLOADED|FAILED         preset changed (reload)                UNLOADED   (new preset at once)
        FAILED (transient)      Settle: its backoff and FAILED_SHOWN_S UNLOADED   (the failure kept as
                                  over, nobody waiting                            last_failure; pin or
                                                                                  load-on-startup: a
                                                                                  load instead)
        without a process       removed (reload)                       the owner ends (late askers: 404)
        READY                   idle for ttl (worker can sleep)        FALLING_ASLEEP (POST /sleep)
        READY                   idle for ttl (server without sleep)    STOPPING   (e.g. a `cmd` llama-server)
        READY                   idle for unload-after (before ttl)     STOPPING
        FALLING_ASLEEP          SleepDone ok                           SLEEPING   (WAKING if requests came)
        FALLING_ASLEEP          SleepDone failed                       STOPPING
        SLEEPING                ensure_ready / load                    WAKING     (POST /wake)
        SLEEPING                idle for unload-after                  STOPPING
        WAKING                  Ready                                  READY
        READY|DRAINING|FALLING_ASLEEP|SLEEPING
                                unload / evict (nothing in flight)     STOPPING
        STOPPING                Exited                                 UNLOADED   (QUEUED if requests wait)
        STOPPING_AFTER_FAILURE  Exited                                 FAILED     (exit code + log tail kept)
        any with a process      Exited (unexpected)                    FAILED

    A reload that changes only router-side keys (aliases, ttl, unload-after, pin, memory,
    timeouts) applies at once in any phase. A remote upstream is READY forever. A slot (and its
    memory charge) is held from its grant until the process is reaped: it is given back on
    entering a phase without a process.
    "Can sleep" = the server's /health reports `is_sleeping` (our worker's contract).
    """

    UNLOADED = "unloaded"
    QUEUED = "queued"
    SPAWNING = "spawning"
    SPAWNING_THEN_STOP = "spawning_then_stop"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FALLING_ASLEEP = "falling_asleep"
    SLEEPING = "sleeping"
    WAKING = "waking"
    STOPPING = "stopping"
    STOPPING_AFTER_FAILURE = "stopping_after_failure"
    FAILED = "failed"

    @property
    def status(self) -> ModelState:
        return _STATUS[self]

    @property
    def holds_slot(self) -> bool:
        """From the grant until the process is reaped."""
        return self not in (Phase.UNLOADED, Phase.QUEUED, Phase.FAILED)

    @property
    def is_up(self) -> bool:
        """Loaded or asleep: a process that serves (or can be woken), evictable when idle."""
        return self in (Phase.READY, Phase.DRAINING, Phase.FALLING_ASLEEP, Phase.SLEEPING)

    @property
    def is_stopping(self) -> bool:
        return self in (Phase.STOPPING, Phase.STOPPING_AFTER_FAILURE)

    @property
    def is_loading(self) -> bool:
        return self in (Phase.QUEUED, Phase.SPAWNING, Phase.STARTING, Phase.WAKING)


_STATUS: dict[Phase, ModelState] = {
    Phase.UNLOADED: ModelState.UNLOADED,
    Phase.QUEUED: ModelState.LOADING,
    Phase.SPAWNING: ModelState.LOADING,
    Phase.SPAWNING_THEN_STOP: ModelState.STOPPING,
    Phase.STARTING: ModelState.LOADING,
    Phase.READY: ModelState.READY,
    Phase.DRAINING: ModelState.READY,
    Phase.FALLING_ASLEEP: ModelState.SLEEPING,
    Phase.SLEEPING: ModelState.SLEEPING,
    Phase.WAKING: ModelState.LOADING,
    Phase.STOPPING: ModelState.STOPPING,
    Phase.STOPPING_AFTER_FAILURE: ModelState.STOPPING,
    Phase.FAILED: ModelState.FAILED,
}
