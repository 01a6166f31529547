"""The server's one worker: a bounded queue of questions and a continuous batch decoding them.

One thread runs every model call (torch uses the cores; the event loop stays free to accept
and stream). Between two decode steps it starts every waiting question that fits (up to
`max_batch` decoding at once): retrieves, loads its caches, prefills it together with the
questions that arrived with it, and streams its first token, then the question joins its
model's running batch (`lm.batching`). So a question waits for one decode step of the others,
not for their whole answers. A lone question is decoded exactly as `cachegraft ask` decodes it,
so its answer is the CLI's. Between steps the worker also looks for a store that changed on
disk (an append committed by `encode`, a new index version) and swaps in a fresh snapshot of
it: a question is retrieved and loaded from one store state and one index state.
"""

from __future__ import annotations

import enum
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.errors import CacheGraftError
from cachegraft_cli.serving.requests import RequestError

if TYPE_CHECKING:  # torch and the models load only when the worker opens its stores
    from cachegraft_cli.answering.ask import Asker, Prepared
    from cachegraft_cli.lm.batching import RunningBatch
    from cachegraft_cli.lm.generation import Row

# What changes when an append commits or an index version is published (`store_state`):
# the manifest's segment names, and the index's current version (None: no index yet).
StoreState = tuple[tuple[str, ...], Any]


class Busy(RequestError):
    """The queue is full (429) or the server is shutting down (503); `retry_after` in seconds."""

    def __init__(self, message: str, hint: str = "", status: int = 429, retry_after: int = 1):
        super().__init__(message, hint, status=status, code="queue_full" if status == 429 else "shutting_down")
        self.retry_after = retry_after

    def __reduce__(self):
        return (type(self), (self.message, self.hint, self.status, self.retry_after))


class JobKind(enum.Enum):
    """What a job asks of the worker. Only ASK joins a decode batch; the others run between
    decode steps."""

    ASK = "ask"
    RETRIEVE = "retrieve"
    RELOAD = "reload"


@dataclass(eq=False)
class Job:
    """One question (or retrieval, or reload) waiting for the worker. `on_text` is called on the
    worker thread with each new piece of the answer; `cancel()` (the client went away) drops it
    from the queue, or stops its decode after the current token. `future` ends with the JSON
    object the endpoint returns (`ask --json`'s result, a retrieval, a reload report)."""

    kind: JobKind
    store: str
    question: str = ""
    options: AskOptions = field(default_factory=AskOptions)
    on_text: Callable[[str], None] | None = None
    future: Future[dict[str, Any]] = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    released: bool = False


@dataclass(frozen=True)
class Decoding:
    """What rides with a question's row in a running batch (`Row.tag`): its job, and what its
    asker prepared (the model it decodes on, and what its result is made from)."""

    job: Job
    prepared: Prepared


@dataclass(frozen=True)
class WorkerOptions:
    max_queue: int = 64  # questions waiting or being answered; one more gets 429
    max_batch: int = 8  # questions decoded together
    gather_seconds: float = 0.005  # how long the worker waits for companions once it has a question
    watch_seconds: float = 2.0  # how often the stores are checked for changes (0: only on /v1/reload)


class Worker:
    """The stores (by name), their loaded models, the queue and the one thread that runs every model call."""

    def __init__(self, stores: dict[str, str], overrides=None, index_kind: str | None = None,
                 options: WorkerOptions | None = None, log: Callable[[str], None] | None = None):
        self.urls = dict(stores)
        self.overrides, self.index_kind = overrides, index_kind
        self.options = options or WorkerOptions()
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.askers: dict[str, Asker] = {}
        self.states: dict[str, StoreState] = {}
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._admitted = 0
        self._closing = False
        self._checked = time.monotonic()
        self._thread: threading.Thread | None = None
        self._running: dict[int, RunningBatch] = {}  # one per loaded model (by id)
        self.batches: Counter[int] = Counter()  # how many questions started together, by count (GET /health)

    # -- set-up (before the server accepts anything) -------------------------------------------------

    def open(self, system: str) -> None:
        """Open every store and its index, check that it serves `system`, load the models once."""
        for name, url in self.urls.items():
            self.states[name] = store_state(url)
            self.askers[name] = self._asker(url)
            self.askers[name].check_system(system)
        for asker in self.askers.values():
            asker.warm(system)

    def _asker(self, url: str) -> Asker:
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
        from cachegraft_cli.lm import openmp

        # The models were loaded on this thread, which holds an OpenMP thread pool; with the
        # worker's own, libgomp stops spinning and each decode step slows by a third or more.
        openmp.release_pool()
        self._thread = threading.Thread(target=self._loop, name="cachegraft-serve-worker", daemon=True)
        self._thread.start()

    # -- the event loop's side ---------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Queue `job`, or raise `Busy` at once (never wait for room)."""
        with self._cond:
            if self._closing:
                raise Busy("The server is shutting down.", "Retry against a running server.", status=503)
            if self._admitted >= self.options.max_queue:
                raise Busy(f"The server is busy: {self._admitted} questions are waiting or being answered "
                           f"(its --max-queue is {self.options.max_queue}).", "Retry after the Retry-After seconds.")
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
            return {"waiting": len(self._queue), "admitted": self._admitted, "limit": self.options.max_queue,
                    "decoding": self._decoding(),
                    "batches": {str(size): n for size, n in sorted(self.batches.items())}}

    def close(self, timeout: float | None = None) -> None:
        """Answer what is queued, then stop the worker. With a `timeout`, what is still queued or
        decoding after that many seconds is cancelled (each row stops after its current token)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.cancel_all()
            self._thread.join(timeout)

    def cancel_all(self) -> None:
        """Cancel every job queued or decoding (as if each client had gone)."""
        with self._cond:
            queued = list(self._queue)
        decoding = [row.tag.job for batch in list(self._running.values()) for row in list(batch.rows)]
        for job in queued + decoding:
            self.cancel(job)

    def _release(self, job: Job) -> None:
        with self._cond:
            if not job.released:
                job.released = True
                self._admitted -= 1

    # -- the worker thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            jobs = self._next()
            if jobs is None:
                return
            self._watch()
            for job in jobs:
                if job.kind is not JobKind.ASK:
                    self._run_other(job)
            self._start([j for j in jobs if j.kind is JobKind.ASK])
            self._step()

    def _decoding(self) -> int:
        return sum(len(b) for b in self._running.values())

    def _next(self) -> list[Job] | None:
        """The jobs to start before the next decode step: every waiting retrieval or reload, and
        the waiting questions that fit in the running batches (`max_batch` rows in all). Waits
        only when nothing is decoding: up to `gather_seconds` for companions of a first question,
        or a quiet interval (then [] : time to look at the stores). None once closing with
        nothing left."""
        s = self.options
        with self._cond:
            if not self._queue and not self._decoding():
                if self._closing:
                    return None
                self._cond.wait(timeout=s.watch_seconds or None)
                return []
            if not self._decoding() and self._queue[0].kind is JobKind.ASK:
                deadline = time.monotonic() + s.gather_seconds  # companions arriving by then start together
                while len(self._queue) < s.max_batch and time.monotonic() < deadline:
                    self._cond.wait(timeout=deadline - time.monotonic())
            room = s.max_batch - self._decoding()
            jobs = []
            for job in list(self._queue):
                asks = job.kind is JobKind.ASK
                if not asks or room > 0:
                    room -= asks
                    jobs.append(job)
                    self._queue.remove(job)
            return jobs

    def _run_other(self, job: Job) -> None:
        """A retrieval or a reload, between decode steps."""
        if job.cancelled.is_set() or not job.future.set_running_or_notify_cancel():
            self._release(job)
            return
        if job.kind is JobKind.RELOAD:
            self._settle(job, lambda: self.reload(force=True))
        else:
            self._settle(job, lambda: self._retrieve(job))

    def _settle(self, job: Job, compute: Callable[[], dict[str, Any]]) -> None:
        """Free the job's slot, then hand its result (or its error) to the waiting request: a client
        that has read its answer never finds its own slot still held."""
        try:
            result = compute()
        except Exception as exc:  # noqa: BLE001 - every failure goes to the waiting request, never kills the worker
            self._release(job)
            job.future.set_exception(exc)
        else:
            self._release(job)
            job.future.set_result(result)

    def _start(self, jobs: list[Job]) -> None:
        """Prepare each question (retrieve, load its caches), then prefill the ones that share a
        model together and let them join that model's running batch."""
        from cachegraft_cli.lm.batching import Row

        by_model: dict[int, list[Row]] = {}
        for job in jobs:
            if job.cancelled.is_set() or not job.future.set_running_or_notify_cancel():
                self._release(job)
                continue
            try:
                prepared = self.askers[job.store].prepare(job.question, job.options)
            except Exception as exc:  # noqa: BLE001 - this question's error, the others go on
                self._fail([job], exc)
                continue
            row = Row(prepared.prompt, job.options.generation, job.on_text, job.cancelled.is_set,
                      prepared.started, Decoding(job, prepared))
            by_model.setdefault(id(prepared.lm), []).append(row)
        for rows in by_model.values():
            lm = rows[0].tag.prepared.lm
            batch = self._batch_for(lm)
            self.batches[len(rows)] += 1
            try:
                finished = batch.admit(rows)
            except Exception as exc:  # noqa: BLE001
                self._fail([r.tag.job for r in rows], exc)
                continue
            self._finish(finished, lm)

    def _batch_for(self, lm) -> RunningBatch:
        from cachegraft_cli.lm.batching import RunningBatch

        if id(lm) not in self._running:
            self._running[id(lm)] = RunningBatch(lm)
        return self._running[id(lm)]

    def _step(self) -> None:
        """One decode step of each running batch; answered rows leave it."""
        for key, batch in list(self._running.items()):
            if not len(batch):
                continue
            try:
                finished = batch.step()
            except Exception as exc:  # noqa: BLE001 - the batch's questions fail, the server goes on
                self._fail([r.tag.job for r in batch.rows], exc)
                del self._running[key]
                continue
            self._finish(finished, batch.lm)

    def _finish(self, rows: list[Row], lm) -> None:
        for row in rows:
            tag: Decoding = row.tag
            self._settle(tag.job, lambda: tag.prepared.result(row.generation(lm.tokenizer)))  # noqa: B023 - called at once

    def _fail(self, jobs: list[Job], exc: BaseException) -> None:
        for job in jobs:
            self._release(job)
            if not job.future.done():
                job.future.set_exception(exc)

    def _retrieve(self, job: Job) -> dict:
        asker = self.askers[job.store]
        hits = asker.retrieve(job.question, job.options.k)
        rows = asker.store.get_rows([h.id for h in hits])
        return {"question": job.question, "store": job.store, "k": job.options.k,
                "passages": [{"id": h.id, "title": r.title, "score": round(float(h.score), 4)}
                             for h, r in zip(hits, rows)]}

    # -- stores changing on disk -------------------------------------------------------------------

    def _watch(self) -> None:
        every = self.options.watch_seconds
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

    def _swap(self, name: str, url: str, state: StoreState) -> bool:
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


def store_state(url: str) -> StoreState:
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
