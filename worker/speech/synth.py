"""`Synthesizer`: the one thread that owns the voice. It loads it, runs one job at a time (a
job is a request's sentences, spoken in order, each handed to the request's asyncio queue as it
is done), sleeps (drops the network) and wakes (loads it again). HTTP handlers only enqueue.

A job whose client left is marked cancelled and stops after its current sentence. A job that
arrives while the voice sleeps wakes it first.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from worker.media_encoding.audio import Samples
from worker.speech.metrics import SpeechMetrics
from worker.speech.voice import Voice

log = logging.getLogger("worker.speech")

Piece = tuple[str, Samples]  # a sentence and its samples
END = None  # after the last piece


@dataclass
class Job:
    sentences: list[str]
    speaker_id: int
    speed: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Piece | BaseException | None] = field(default_factory=asyncio.Queue)
    is_cancelled: bool = False

    def put(self, item: Piece | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass
class _Control:
    action: Callable[[], None]
    done: Future[None]


class Synthesizer:
    def __init__(self, model: str, threads: int | None, metrics: SpeechMetrics,
                 on_load_failed: Callable[[], None]) -> None:
        self.model = model
        self.threads = threads
        self.metrics = metrics
        self._on_load_failed = on_load_failed
        self._voice: Voice | None = None
        self._queue: queue.SimpleQueue[Job | _Control | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="speech", daemon=True)
        self.is_ready = False
        self.is_sleeping = False
        self.error: str | None = None
        self.sample_rate = 0
        self.last_busy = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)

    def submit(self, job: Job) -> None:
        self.metrics.requests_waiting += 1
        self._queue.put(job)

    def sleep(self) -> Future[None]:
        return self._control(self._sleep)

    def wake(self) -> Future[None]:
        return self._control(self._wake)

    def _control(self, action: Callable[[], None]) -> Future[None]:
        done: Future[None] = Future()
        self._queue.put(_Control(action, done))
        return done

    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # any failure to load: /health says why, the process exits
            self.error = f"{type(e).__name__}: {e}"
            log.error("model load failed: %s", self.error)  # the line the router reports (load_failure.py)
            self._on_load_failed()
            return
        self.is_ready = True
        log.info("model loaded: %s (%d Hz)", self.model, self.sample_rate)
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Control):
                try:
                    item.action()
                    item.done.set_result(None)
                except Exception as e:
                    item.done.set_exception(e)
            else:
                self._speak(item)

    def _load(self) -> None:
        t0 = time.perf_counter()
        self._voice = Voice(self.model, self.threads)
        self.sample_rate = self._voice.sample_rate
        self.metrics.load_seconds = time.perf_counter() - t0

    def _sleep(self) -> None:
        self._voice = None  # the session's memory goes with it
        self.is_sleeping = True
        log.info("sleeping: voice unloaded")

    def _wake(self) -> None:
        if self._voice is None:
            self._load()
        self.is_sleeping = False

    def _speak(self, job: Job) -> None:
        m = self.metrics
        m.requests_waiting -= 1
        m.requests_processing += 1
        try:
            if self._voice is None:
                self._wake()
            assert self._voice is not None
            for sentence in job.sentences:
                if job.is_cancelled:
                    break
                t0 = time.perf_counter()
                samples = self._voice.speak(sentence, job.speaker_id, job.speed)
                m.add(len(sentence), samples.size / self.sample_rate, time.perf_counter() - t0)
                job.put((sentence, samples))
            job.put(END)
        except Exception as e:  # a bad sentence fails its request, not the worker
            log.exception("synthesis failed")
            job.put(e)
        finally:
            m.requests_processing -= 1
            self.last_busy = time.monotonic()
