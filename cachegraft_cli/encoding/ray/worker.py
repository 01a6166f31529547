"""What runs inside the Ray cluster: the store set-up task and the fusing actor.

Imported by Ray workers only (and by the driver, to hand them over); it never
imports ray itself, so the library stays importable without it.
"""

from __future__ import annotations

import json
from collections import defaultdict

from cachegraft_cli.encoding.plan import Chunk, EncodeOptions, EncodeSummary, encode_window, run_info
from cachegraft_cli.errors import CacheGraftError
from cachegraft_cli.session import ModelChoice, ModelSession
from cachegraft_cli.store.codecs import DEFAULT_CODEC

RUNNER = "ray"


def create_store(choice: ModelChoice, store_url: str, codec: str, also_own_cache: bool,
                 compressor: str | None = None, codec_params: dict | None = None) -> dict | None:
    """Make the store (prefix cache, identity) exactly as the local runner does; runs where the models can load.
    Our own errors come back as data (`error_record`), not raised: Ray would wrap them."""
    from cachegraft_cli.store.target import Target

    try:
        ModelSession(choice).open_or_create_store(Target.open(store_url), codec, also_own_cache, compressor=compressor,
                                                  codec_params=codec_params)
    except CacheGraftError as exc:
        return error_record(exc)
    return None


def error_record(exc: CacheGraftError) -> dict:
    return {"error": {"type": type(exc).__name__, "message": exc.message, "hint": exc.hint}}


def raise_error_record(record: dict | None) -> None:
    """Raise the error a worker reported (`error_record`), as the same type."""
    from cachegraft_cli import errors

    if record and "error" in record:
        err = record["error"]
        cls = getattr(errors, err["type"], None)
        cls = cls if isinstance(cls, type) and issubclass(cls, CacheGraftError) else CacheGraftError
        raise cls(err["message"], err["hint"])


class FuseWriter:
    """A Ray Data callable class: the models load once per actor, in `__init__`.

    Each call gets whole commit windows (one dataset block each) and writes each
    window as one complete, unlisted segment; it returns one row per segment
    with the plan positions of its rows, for the driver to list.
    """

    def __init__(self, choice: ModelChoice, store_url: str, options: EncodeOptions):
        from cachegraft_cli.store import CacheStore

        self.options = options
        self.error: CacheGraftError | None = None
        try:
            self.session = ModelSession(choice)
            # a node with other weights, tokenizer or settings is refused here, before it writes anything
            self.store = CacheStore.open(store_url, expect=self.session.identity(options.codec or DEFAULT_CODEC))
        except CacheGraftError as exc:  # reported with the first window: Ray would only say the actor died
            self.error = exc

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {"window": [], "seqs": [], "entry": []}
        for window, seqs, chunks in windows_of(batch):
            try:
                if self.error is not None:
                    raise self.error
                entry = self.write_segment(chunks)
            except CacheGraftError as exc:  # not worth a retry (bad model, store, input): the driver stops
                entry, seqs = error_record(exc), []
            out["window"].append(window)
            out["seqs"].append(json.dumps(seqs))
            out["entry"].append(json.dumps(entry))
        return out

    def write_segment(self, chunks: list[Chunk]) -> dict:
        """One window -> one complete segment (up to its commit.json), not listed."""
        from cachegraft_cli.store.parallel import SegmentWriter

        summary = EncodeSummary(store=self.store.loc.url)
        with SegmentWriter(self.store, run_info(chunks, RUNNER)) as writer:
            encode_window(chunks, writer, self.session, self.options, summary)
            entry = writer.commit()
        if entry is None:  # windows are never empty
            raise ValueError("a window with no passages was handed to an actor")
        return entry


def windows_of(batch: dict) -> list[tuple[int, list[int], list[Chunk]]]:
    """(window, plan positions, chunks) per window in a batch (numpy columns), each in plan order."""
    grouped: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    for window, seq, ids, text in zip(batch["window"].tolist(), batch["seq"].tolist(), batch["ids"],
                                      batch["chunk"].tolist()):
        grouped[int(window)].append((int(seq), {**json.loads(text), "ids": [int(t) for t in ids]}))
    out = []
    for window in sorted(grouped):
        rows = sorted(grouped[window], key=lambda r: r[0])
        out.append((window, [s for s, _ in rows], [Chunk.from_record(r) for _, r in rows]))
    return out
