"""The server's one worker: a bounded queue of questions, and the decode loop that answers
together the questions that arrived together.

One thread runs every model call (torch uses the cores; the event loop stays free to accept
and stream). It takes the oldest question and every other waiting one with the same store
and options (up to `max_batch`) and decodes them in one batch (`Asker.ask_many`); a lone
question goes through `Asker.ask`, the path `cachegraft ask` takes, so its answer is the
CLI's. Between batches it looks for a store that changed on disk (an append committed by
`encode`, a new index version) and swaps in a fresh snapshot of it, so every answer is read
from one store state and one index state.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.errors import CacheGraftError, NoPassagesError
from cachegraft_cli.serving.requests import RequestError


class Busy(RequestError):
    """The queue is full (429) or the server is shutting down (503); `retry_after` in seconds."""

    def __init__(self, message: str, hint: str = "", status: int = 429, retry_after: int = 1):
        super().__init__(message, hint, status=status, code="queue_full" if status == 429 else "shutting_down")
        self.retry_after = retry_after

    def __reduce__(self):
        return (type(self), (self.message, self.hint, self.status, self.retry_after))


@dataclass(eq=False)
class Job:
    """One question (or retrieval, or reload) waiting for the worker. `on_text` is called on the
    worker thread with each new piece of the answer; `cancel()` (the client went away) drops it
    from the queue, or stops its decode after the current token."""

    kind: str  # "ask", "retrieve" or "reload"
    store: str
    question: str = ""
    options: AskOptions = field(default_factory=AskOptions)
    on_text: Callable[[str], None] | None = None
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    released: bool = False

    def same_batch(self, other: Job) -> bool:
        return (self.kind, self.store, self.options) == (other.kind, other.store, other.options)


@dataclass(frozen=True)
class EngineSettings:
    max_queue: int = 64  # questions waiting or being answered; one more gets 429
    max_batch: int = 8  # questions decoded together
    gather_seconds: float = 0.025  # how long the worker waits for companions once it has a question
    watch_seconds: float = 2.0  # how often the stores are checked for changes (0: only on /v1/reload)


class Engine:
    """The stores (by name), their loaded models, the queue and the worker thread."""

    def __init__(self, stores: dict[str, str], overrides=None, index_kind: str | None = None,
                 settings: EngineSettings | None = None, log: Callable[[str], None] | None = None):
        self.urls = dict(stores)
        self.overrides, self.index_kind = overrides, index_kind
        self.settings = settings or EngineSettings()
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.askers: dict[str, Any] = {}
        self.states: dict[str, tuple] = {}
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._admitted = 0
        self._closing = False
        self._checked = time.monotonic()
        self._thread: threading.Thread | None = None
        self.batches: Counter[int] = Counter()  # how many batches of each size were decoded (GET /health)

    # -- set-up (before the server accepts anything) -------------------------------------------------

    def open(self, system: str) -> None:
        """Open every store and its index, check that it serves `system`, load the models once."""
        for name, url in self.urls.items():
            self.states[name] = store_state(url)
            self.askers[name] = self._asker(url)
            self.askers[name].check_system(system)
        for asker in self.askers.values():
            asker.warm(system)

    def _asker(self, url: str):
        """An Asker of the store as it is now, sharing loaded models with any other that uses the same ones."""
        from cachegraft_cli.answering.ask import Asker

        asker = Asker(url, self.overrides, self.index_kind)
        for other in self.askers.values():
            if other.session.choice == asker.session.choice:
                asker.session = other.session
                break
        return asker

    def start(self) -> None:
        """Start the worker (once; a second call does nothing)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="cachegraft-serve-worker", daemon=True)
        self._thread.start()

    # -- the event loop's side ---------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Queue `job`, or raise `Busy` at once (never wait for room)."""
        with self._cond:
            if self._closing:
                raise Busy("The server is shutting down.", "Retry against a running server.", status=503)
            if self._admitted >= self.settings.max_queue:
                raise Busy(f"The server is busy: {self._admitted} questions are waiting or being answered "
                           f"(its --max-queue is {self.settings.max_queue}).", "Retry after the Retry-After seconds.")
            self._admitted += 1
            self._queue.append(job)
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: free its slot now; a queued job never runs, a running one stops."""
        job.cancelled.set()
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                job.future.cancel()
        self._release(job)

    def load(self) -> dict:
        with self._cond:
            return {"waiting": len(self._queue), "admitted": self._admitted, "limit": self.settings.max_queue,
                    "batches": {str(size): n for size, n in sorted(self.batches.items())}}

    def close(self) -> None:
        """Answer what is queued, then stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _release(self, job: Job) -> None:
        with self._cond:
            if not job.released:
                job.released = True
                self._admitted -= 1

    # -- the worker thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            group = self._next()
            if group is None:
                return
            self._watch()
            if group:
                self._run(group)

    def _next(self) -> list[Job] | None:
        """The next batch: the oldest job and the waiting ones it can be decoded with. [] on a
        quiet interval (time to look at the stores), None once closing with nothing left."""
        s = self.settings
        with self._cond:
            if not self._queue:
                if self._closing:
                    return None
                self._cond.wait(timeout=s.watch_seconds or None)
                return []
            first = self._queue.popleft()
            deadline = time.monotonic() + s.gather_seconds  # companions arriving by then join this batch
            while first.kind == "ask" and len(self._queue) < s.max_batch - 1 and time.monotonic() < deadline:
                self._cond.wait(timeout=deadline - time.monotonic())
            group = [first] + [j for j in self._queue if j.same_batch(first)][: s.max_batch - 1]
            for job in group[1:]:
                self._queue.remove(job)
            return group if first.kind == "ask" else [first]

    def _run(self, group: list[Job]) -> None:
        live = [j for j in group if not j.cancelled.is_set() and j.future.set_running_or_notify_cancel()]
        try:
            if live:
                if live[0].kind == "ask":
                    self.batches[len(live)] += 1
                self._answer(live)
        finally:
            for job in group:
                self._release(job)

    def _answer(self, group: list[Job]) -> None:
        first = group[0]
        try:
            if first.kind == "reload":
                first.future.set_result(self.reload(force=True))
            elif first.kind == "retrieve":
                first.future.set_result(self._retrieve(first))
            elif len(group) == 1:
                first.future.set_result(self._ask(first))
            else:
                self._ask_together(group)
        except Exception as exc:  # noqa: BLE001 - every failure goes to the waiting request, never kills the worker
            for job in group:
                if not job.future.done():
                    job.future.set_exception(exc)

    def _ask(self, job: Job) -> dict:
        return self.askers[job.store].ask(job.question, job.options, on_text=job.on_text,
                                          cancelled=job.cancelled.is_set)

    def _ask_together(self, group: list[Job]) -> None:
        from cachegraft_cli.lm.generation import RowStreams

        asker = self.askers[group[0].store]
        streams = RowStreams([j.on_text for j in group], lambda row: group[row].cancelled.is_set())
        try:
            results = asker.ask_many([j.question for j in group], group[0].options, len(group), streams)
        except NoPassagesError:  # one question found nothing: answer each alone, so only that one fails
            for job in group:
                self._answer([job])
            return
        for job, result in zip(group, results):
            job.future.set_result(result)

    def _retrieve(self, job: Job) -> dict:
        asker = self.askers[job.store]
        hits = asker.retrieve(job.question, job.options.k)
        rows = asker.store.get_rows([h.id for h in hits])
        return {"question": job.question, "store": job.store, "k": job.options.k,
                "passages": [{"id": h.id, "title": r.title, "score": round(float(h.score), 4)}
                             for h, r in zip(hits, rows)]}

    # -- stores changing on disk -------------------------------------------------------------------

    def _watch(self) -> None:
        every = self.settings.watch_seconds
        if every and time.monotonic() - self._checked >= every:
            try:
                self.reload()
            except Exception as exc:  # noqa: BLE001 - a store mid-change must not stop the worker; next check retries
                self._checked = time.monotonic()
                self.log(f"warning: could not check the stores for changes ({type(exc).__name__}: {exc}).")

    def reload(self, force: bool = False) -> dict:
        """Swap in a fresh snapshot of each store whose manifest or index changed (every one
        with `force`), keeping the loaded models. Runs on the worker, between batches. A store
        that fails to reopen (an index being rebuilt, say) keeps its old snapshot, said on stderr."""
        self._checked = time.monotonic()
        report = {}
        for name, url in self.urls.items():
            state, changed = store_state(url), False
            if force or state != self.states[name]:
                changed = self._swap(name, url, state)
            asker = self.askers[name]
            report[name] = {"passages": len(asker.store), "indexed": len(asker.index), "reloaded": changed}
        return {"stores": report}

    def _swap(self, name: str, url: str, state: tuple) -> bool:
        from cachegraft_cli.answering.ask import Asker

        old = self.askers[name]
        try:
            fresh = Asker(url, self.overrides, self.index_kind, session=old.session)
            fresh.index  # noqa: B018 - open the index now: a bad one is caught here, not mid-answer
        except CacheGraftError as exc:
            self.log(f"warning: store {name} changed but could not be reopened ({exc.message}); "
                     "answering from its previous state.")
            return False
        self.askers[name], self.states[name] = fresh, state
        self.log(f"reloaded store {name}: {len(fresh.store):,} passages, {len(fresh.index):,} indexed")
        return True


def store_state(url: str) -> tuple:
    """What changes when an append commits or an index version is published: the manifest's
    segments and the index's current version (cheap: two small reads)."""
    from cachegraft_cli.retrieval.directory import current
    from cachegraft_cli.store.location import Location
    from cachegraft_cli.store.segments import load_manifest

    manifest = load_manifest(Location.from_url(url))
    try:
        index = current(url)
    except CacheGraftError:
        index = None
    return tuple(s["name"] for s in manifest["segments"]), index
