"""`encode --runner ray`: the same store as the local runner, fused by a pool of Ray actors.

The driver (this process) plans exactly as the local runner does: read and
check the corpus, split long passages, skip what the store holds (same id,
same content hash), cut the rest into commit windows. Only a tokenizer loads
here, so the driver can be a CPU-only head node. Then:

1. the driver takes the store's writer lock for the whole job through
   `Target.locked`, as the local runner does, before anything loads or is
   written (a second writer is refused at once); under it an existing store is
   recovered (`store.recover.recover`: segments of killed jobs deleted, a local
   writer's committed ones adopted);
2. a missing store is created by one Ray task where the models load (prefix
   cache and identity exactly as `encode` makes them), and the plan is made
   against the manifest as it is under the lock;
3. the windows become a Ray dataset, one block per window, and `map_batches`
   runs `FuseWriter` on an actor pool: each actor loads the models once and
   writes each window as one complete, unlisted segment (`SegmentWriter`);
4. as segments finish, the driver lists them (`commit_segments`) in plan order,
   at most every `commit_seconds`, and everything left at the end in one final
   atomic commit.

Same windows, same batches: a window fused by an actor gives the bits the
local runner gives on the same hardware. Retries are safe: a task Ray retries
or a worker that dies leaves an unlisted segment (garbage), the ledger never
lists one plan position twice, and a job re-run after a crash skips every
committed passage.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, replace

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding import calibration
from cachegraft_cli.encoding.plan import Chunk, EncodeOptions, EncodeSummary, commit_windows, plan_chunks
from cachegraft_cli.encoding.ray.ledger import SegmentLedger, SegmentReport
from cachegraft_cli.encoding.ray.worker import raise_error_record
from cachegraft_cli.errors import CacheGraftError, RunnerError, StoreMismatchError, UsageError
from cachegraft_cli.session import ModelChoice
from cachegraft_cli.store.target import Target


@dataclass
class RayOptions:
    address: str | None = None  # None: RAY_ADDRESS if set, else a new local Ray runtime
    actors: int = 1
    gpus_per_actor: float = 0.0
    cpus_per_actor: float = 1.0
    max_retries: int = 3  # per window task
    commit_seconds: float = 10.0  # list finished segments at most this often (the last commit is always made)

    def __post_init__(self):
        if self.actors < 1:
            raise UsageError(f"--actors must be at least 1, not {self.actors}.")
        if self.gpus_per_actor < 0 or self.cpus_per_actor <= 0:
            raise UsageError("--gpus-per-actor must be >= 0 and --cpus-per-actor > 0.",
                             "Fractions share a device: --gpus-per-actor 0.5 puts two actors on each GPU.")
        if self.max_retries < 0:
            raise UsageError(f"max_retries must be >= 0, not {self.max_retries}.")
        if self.address is not None and self.address not in ("auto", "local") and not _host_port(self.address):
            raise UsageError(f"--address {self.address!r} is not HOST:PORT.",
                             "Example: --address 10.0.0.1:6379 (the head's address; see `ray status`).")


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `HOST:PORT` or `ray://HOST:PORT`; None for anything else."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def require_ray():
    """The ray module, or a clear error when the optional extra is not installed."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise UsageError("The ray runner needs Ray, which is not installed.",
                         "Install it with: pip install 'cachegraft[ray]' "
                         "(and 'cachegraft[s3]' for s3:// stores).") from None
    return ray


def encode_on_ray(
    passages: Iterable[Passage],
    target: Target,
    choice: ModelChoice,
    options: EncodeOptions,
    ray_options: RayOptions,
    progress: Callable[[int, int], None] | None = None,
    worker: type | None = None,
    planned: Callable[[int], None] | None = None,
) -> EncodeSummary:
    """Encode passages into `target` (the store the caller opened, checked here once) on a Ray cluster
    (`worker`: the actor class, for tests; `planned(n)`: how many chunks will be encoded, once the
    plan under the lock knows it)."""
    from cachegraft_cli.encoding.ray.worker import FuseWriter

    ray = require_ray()
    check_devices(choice.device, ray_options)
    codec = calibration.store_codec(options.codec, target.codec, choice.fuser)[0]
    options = replace(options, codec=codec)  # the workers open or create the store with it
    target.check(codec, options.kinds, options.keep_for(target.keep), options.compressor)  # before the cluster
    # a new store's calibration is read and checked here, once: the set-up task gets it whole
    params = calibration.codec_params(codec, options.calibration, choice.fuser, target.store is not None)
    if options.keep_for(target.keep) is not None:
        raise UsageError("the Ray runner does not prune passages (--keep below 1) yet.",
                         "Encode a pruned store with --runner local.")
    start = time.perf_counter()
    # The lock first: a second writer is refused at once, before a Ray runtime starts or a model loads.
    with target.locked({"tool": "cachegraft encode", "engine": "ray"}):  # recovered under it
        with _connected(ray, ray_options), _data_context(ray_options):
            store = _open_or_create(ray, choice, target, options, ray_options, params)
            template = driver_template(choice, store, options)
            summary = _run_locked(ray, passages, store, template, choice, options, ray_options, progress,
                                  worker or FuseWriter, planned)
    summary.seconds = round(time.perf_counter() - start, 3)
    summary.finish()
    return summary


def check_devices(device: str | None, ray_options: RayOptions) -> None:
    """GPUs for the actors and a CPU --device contradict each other."""
    if ray_options.gpus_per_actor > 0 and (device or "").startswith(("cpu", "mps")):
        raise UsageError(f"--gpus-per-actor {ray_options.gpus_per_actor:g} asks for GPUs, but --device is "
                         f"{device}.",
                         "Drop --device (each actor uses the GPU Ray gives it), or use --gpus-per-actor 0.")


# -- the cluster ------------------------------------------------------------------


@contextmanager
def _connected(ray, ray_options: RayOptions):
    """Join the cluster (or start a local runtime); leave a runtime someone else started running."""
    if ray.is_initialized():
        yield
        return
    _probe(ray_options.address or os.environ.get("RAY_ADDRESS"))
    try:
        ray.init(address=ray_options.address, logging_level=logging.WARNING, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = ray_options.address or "RAY_ADDRESS / a new local runtime"
        raise RunnerError(f"could not start or join a Ray cluster at {where}: {str(exc).splitlines()[0]}",
                          "Start one with `ray start --head` and pass --address HOST:6379, "
                          "or leave --address out to run a local Ray runtime.") from None
    try:
        if ray_options.address is None and not os.environ.get("RAY_ADDRESS"):
            _check_resources(ray, ray_options)  # a local runtime has what it has; a cluster may scale up
        yield
    finally:
        ray.shutdown()


def _probe(address: str | None, timeout: float = 5.0) -> None:
    """Fail in seconds on an address nothing listens at (Ray itself retries for minutes)."""
    import socket

    target = _host_port(address) if address else None
    if target is None:  # none, "auto" or "local": Ray finds or starts the runtime
        return
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as exc:
        raise RunnerError(f"no Ray cluster answers at {address} ({exc.strerror or exc}).",
                          "Start one with `ray start --head` (port 6379 by default) and check the address, "
                          "or leave --address out to run a local Ray runtime.") from None


def _check_resources(ray, ray_options: RayOptions) -> None:
    """A pool that can never start would wait forever: refuse it up front."""
    have = ray.cluster_resources()
    if ray_options.gpus_per_actor > have.get("GPU", 0):
        raise RunnerError(f"the Ray cluster has {have.get('GPU', 0):g} GPUs, but --gpus-per-actor is "
                          f"{ray_options.gpus_per_actor:g}.",
                          "Join a cluster with GPU nodes (--address), or use --gpus-per-actor 0.")
    if ray_options.cpus_per_actor > have.get("CPU", 0):
        raise RunnerError(f"the Ray cluster has {have.get('CPU', 0):g} CPUs, but --cpus-per-actor is "
                          f"{ray_options.cpus_per_actor:g}.", "Use a smaller --cpus-per-actor.")


@contextmanager
def _data_context(ray_options: RayOptions):
    """Ray Data settings for the job, put back afterwards.

    Progress goes through our own callback (Ray Data's bars and per-run log lines
    would drown it). A window whose task raises (our own errors come back as data,
    so this is IO or a bug) is retried in the same actor up to `max_retries`
    times; an actor that dies is restarted and its tasks retried as often.
    """
    from ray.data import DataContext

    ctx = DataContext.get_current()
    settings = {"enable_progress_bars": False, "print_on_execution_start": False, "retried_map_errors": True,
                "max_map_retries": ray_options.max_retries}
    saved = {name: getattr(ctx, name) for name in settings}
    logger = logging.getLogger("ray.data")
    level = logger.level
    for name, value in settings.items():
        setattr(ctx, name, value)
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ctx, name, value)
        logger.setLevel(level)


# -- the store ----------------------------------------------------------------------


def _open_or_create(ray, choice: ModelChoice, target: Target, options: EncodeOptions, ray_options: RayOptions,
                    codec_params: dict | None = None):
    """The store (one another writer made before the lock was taken is opened by `Target.locked`);
    a missing one is made by a task where the models load (the driver loads none)."""
    from cachegraft_cli.encoding.ray.worker import create_store
    from cachegraft_cli.store import CacheStore

    if target.store is None:
        url = target.loc.raw_url or target.loc.url  # a relative path means the driver's directory, on every node
        task = ray.remote(max_calls=1, num_cpus=ray_options.cpus_per_actor, num_gpus=ray_options.gpus_per_actor)
        raise_error_record(_ray_get(ray, task(create_store).remote(choice, url, options.codec,
                                                                   options.also_own_cache, options.compressor,
                                                                   codec_params)))
        target.store = CacheStore.open(target.loc)
    return target.store


def driver_template(choice: ModelChoice, store, options: EncodeOptions):
    """The prompt template from the receiver's tokenizer alone, checked against the store's."""
    from cachegraft_cli.lm.models import load_tokenizer
    from cachegraft_cli.lm.template import PromptTemplate

    template = PromptTemplate.for_tokenizer(load_tokenizer(choice.receiver, trust_remote_code=choice.trust_remote_code),
                                            choice.instruction)
    stored = store.identity
    for key, mine in (("codec", options.codec), ("template", template.identity()),
                      ("prefix_token_ids", template.prefix_ids())):
        if stored.get(key) != mine:
            raise StoreMismatchError(f"store {store.loc.url} was made with another {key} than this encode asks for.",
                                     f"Use another --store, or the models and settings it was made with "
                                     f"(see `cachegraft store info {store.loc.url}`).")
    return template


def _run_locked(ray, passages, store, template, choice, options, ray_options, progress, worker,
                planned) -> EncodeSummary:
    """Under the driver's writer lock (held, and the store recovered, by the caller for the whole
    job): plan, fuse."""
    summary = EncodeSummary(store=store.loc.url, fuser=choice.fuser or "closed")
    windows = list(commit_windows(plan_chunks(passages, store.content_hashes(), template, options, summary), options))
    if planned:
        planned(sum(len(w) for w in windows))
    if windows:
        _fuse_windows(ray, windows, store, choice, options, ray_options, summary, progress, worker)
    return summary


# -- the job ---------------------------------------------------------------------


def _fuse_windows(ray, windows: list[list[Chunk]], store, choice, options, ray_options, summary, progress, worker):
    from ray.data import ActorPoolStrategy

    planned = sum(len(w) for w in windows)
    committer = _Committer(store.loc, SegmentLedger(planned), ray_options.commit_seconds, summary, progress)
    with warnings.catch_warnings():  # max_task_retries has no named parameter yet (ray 2.60)
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*is deprecated")
        results = _dataset(ray, windows).map_batches(
            worker, batch_size=None, batch_format="numpy", compute=ActorPoolStrategy(size=ray_options.actors),
            num_cpus=ray_options.cpus_per_actor, num_gpus=ray_options.gpus_per_actor,
            fn_constructor_kwargs={"choice": choice, "store_url": store.loc.raw_url or store.loc.url,
                                   "options": options},
            max_task_retries=ray_options.max_retries)  # tasks of a dead actor: bounded, not Ray Data's -1 (forever)
    try:
        for row in results.iter_rows():
            entry = json.loads(row["entry"])
            raise_error_record(entry)
            committer.add(SegmentReport(json.loads(row["seqs"]), entry))
    except BaseException as exc:
        committer.flush(final=True)  # keep what finished in order: a re-run skips it
        if isinstance(exc, Exception) and not isinstance(exc, CacheGraftError):
            raise _runner_error(exc) from None
        raise
    committer.flush(final=True)
    if not committer.ledger.complete:
        raise RunnerError(f"the Ray job ended with {committer.ledger.missing} planned passages in no segment.",
                          "Run the same encode again: what is stored is skipped, the rest is redone.")


def _dataset(ray, windows: list[list[Chunk]]):
    """One block per commit window, so each window reaches one actor call whole. Token ids travel
    as an int32 list column (a quarter of their JSON size); the rest of a chunk as JSON."""
    import pyarrow as pa

    tables, seq = [], 0
    for w, window in enumerate(windows):
        records = [c.to_record() for c in window]
        ids = [r.pop("ids") for r in records]
        tables.append(pa.table({"window": pa.array([w] * len(window), pa.int64()),
                                "seq": pa.array(range(seq, seq + len(window)), pa.int64()),
                                "ids": pa.array(ids, pa.list_(pa.int32())),
                                "chunk": [json.dumps(r, ensure_ascii=False) for r in records]}))
        seq += len(window)
    return ray.data.from_arrow(tables)


class _Committer:
    """Lists finished segments in plan order, throttled; counts what they hold."""

    def __init__(self, loc, ledger: SegmentLedger, every: float, summary: EncodeSummary, progress):
        self.loc, self.ledger, self.every = loc, ledger, every
        self.summary, self.progress = summary, progress
        self.last: float | None = None

    def add(self, report: SegmentReport) -> None:
        if not self.ledger.accept(report):
            return  # a second run of a finished window: its segment stays unlisted, garbage for the next writer
        if self.progress:
            self.progress(report.entry["rows"], report.entry["tokens"])
        self.flush(final=False)

    def flush(self, final: bool) -> None:
        now = time.monotonic()
        if not final and self.last is not None and now - self.last < self.every:
            return
        ready = self.ledger.ready()
        if not ready:
            return
        from cachegraft_cli.store.parallel import commit_segments

        commit_segments(self.loc, [r.entry for r in ready])
        self.last = now
        for r in ready:
            self.summary.segments.append(r.entry["name"])
            self.summary.added += r.entry["rows"]
            self.summary.tokens += r.entry["tokens"]
            self.summary.bytes += sum(r.entry["bytes"].values())


# -- errors ------------------------------------------------------------------------


def _ray_get(ray, ref):
    try:
        return ray.get(ref)
    except Exception as exc:  # noqa: BLE001 - a task's error arrives wrapped; unwrap ours
        raise _runner_error(exc) from None


def _runner_error(exc: BaseException) -> CacheGraftError:
    """Our own error raised in a worker (models, store identity), else an RunnerError naming the failure."""
    seen = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, CacheGraftError) and type(cur).__module__.startswith("cachegraft_cli"):
            return type(cur)(cur.message, cur.hint)
        seen.add(id(cur))
        cur = getattr(cur, "cause", None) or cur.__cause__ or cur.__context__
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return RunnerError(f"the Ray job failed: {type(exc).__name__}: {first[:300]}",
                       "Committed segments are kept; fix the cause and run the same encode again to finish.")
