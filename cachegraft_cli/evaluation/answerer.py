"""The evaluation's answerer: CacheGraft itself.

Each benchmark's corpus is encoded once into a store per fuser under
`stores_dir` (later runs reuse it: encode skips what is stored), indexed with
BM25, and answered with `Asker`. `graft` reads the main fuser's store,
`adapter` the adapter fuser's, `mismatched` the main fuser's control store
(`encode --mismatched-sharer`); `cache`, `text`, `closed` and `sharer-text`
use the main store (its own-cache kind, its passages, its models).
"""

from __future__ import annotations

import gc
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cachegraft_cli.answering.assembly import DEFAULT_RECOMPUTE
from cachegraft_cli.encoding.keep import DEFAULT_KEEP_BY
from cachegraft_cli.encoding.plan import PASSAGE_TOKENS
from cachegraft_cli.errors import NoPassagesError, UsageError
from cachegraft_cli.store.codecs import DEFAULT_CODEC

if TYPE_CHECKING:
    from cachegraft_cli.session import ModelSession


@dataclass
class AnswererConfig:
    receiver: str
    sharer: str | None
    fuser: str | None
    adapter_fuser: str | None = None
    codec: str = DEFAULT_CODEC
    keep: float = 1.0  # share of each passage's tokens the stores keep (`encode --keep`)
    keep_by: str = DEFAULT_KEEP_BY
    scheme: str = "rotate"
    order: str = "best-last"
    recompute: int = DEFAULT_RECOMPUTE
    blend: float = 0.0
    blend_layer: int = 1
    index_kind: str = "bm25"
    max_new_tokens: int = 32
    answer_batch: int = 1  # questions decoded together; >1 is faster, its greedy answers may differ in the last bit
    encode_batch_size: int = 8
    device: str | None = None
    dtype: str | None = None
    stores_dir: str = "stores"
    extra: dict = field(default_factory=dict)

    def results_key(self) -> dict:
        """What the answers depend on (saved with the run, checked on resume)."""
        d = asdict(self)
        d.pop("stores_dir")
        d.pop("encode_batch_size")
        if d["answer_batch"] == 1:
            d.pop("answer_batch")  # one at a time: the key runs made before the option was added
        if d["keep"] >= 1:
            d.pop("keep"), d.pop("keep_by")  # every token: the key runs made before pruning existed
        return d

    def store_settings(self, overrides: dict | None = None) -> tuple[str, float, str, int]:
        """(codec, keep, keep_by, notes) of the store a system label answers from."""
        o = overrides or {}
        keep = float(o.get("keep", self.keep))
        keep_by = o.get("keep_by", self.keep_by) if keep < 1 else DEFAULT_KEEP_BY
        return o.get("codec", self.codec), keep, keep_by, int(o.get("notes", 0))


class ReusedFusion:
    """A `PassageFusion` whose results are kept by batch: the stores an evaluation encodes from
    one corpus (other codecs, keep ratios) get the very same fused caches, computed once. Attention
    scores are always computed (the forward's caches are the same bits with or without them)."""

    def __init__(self, fusion):
        self.fusion = fusion
        self.kept: dict[tuple, list] = {}

    def __getattr__(self, name):
        return getattr(self.fusion, name)

    def fuse(self, passages: list[list[int]], attention: bool = False, donors: list[list[int]] | None = None) -> list:
        key = (tuple(tuple(p) for p in passages), tuple(tuple(d) for d in donors) if donors is not None else None)
        if key not in self.kept:
            self.kept[key] = self.fusion.fuse(passages, attention=True, donors=donors)
        return self.kept[key]


class StoreAnswerer:
    def __init__(self, config: AnswererConfig, systems: list[str]):
        from cachegraft_cli.evaluation.variants import base_system, parse_variant

        self.config = config
        self.labels = list(systems)
        self.systems = sorted({base_system(s) for s in systems})  # what stores and models are needed for
        settings = {s: config.store_settings(parse_variant(s).store) for s in systems}
        self.stores_needed = list(dict.fromkeys(settings.values()))
        self.mismatched_needed = list(dict.fromkeys(v for s, v in settings.items() if base_system(s) == "mismatched"))
        self._askers: dict[tuple, object] = {}
        self._sessions: dict[str, ModelSession] = {}
        self._chunk_tokens: dict[str, int] = {}  # benchmark -> the max_passage_tokens it was prepared with
        self._corpus: dict[str, str] = {}  # benchmark -> its passages' fingerprint (`corpus_fingerprint`)

    def _fuser_for(self, system: str) -> str | None:
        if system == "adapter":
            if not self.config.adapter_fuser:
                raise UsageError("The adapter system needs --adapter-fuser (this preset or fuser ships none).",
                                 "Pass the adapter fuser (trained with --sharer-input zero), or use a preset "
                                 "that ships one (`cachegraft models list`).")
            return self.config.adapter_fuser
        return self.config.fuser

    def _store_url(self, bench: str, fuser: str | None, settings: tuple | None = None,
                   mismatched: bool = False) -> str:
        codec, keep, keep_by, notes = settings or self.config.store_settings()
        parts: list = [self.config.receiver, self.config.sharer, fuser, codec]
        if keep < 1:  # a pruned store has its own key; an unpruned one keeps the key it always had
            parts += [keep, keep_by]
        if notes:  # the sharer's notes (`encoding.notes`)
            parts.append({"notes": notes})
        if mismatched:  # the mismatched-sharer control (`encoding.donors`)
            parts.append("mismatched")
        tokens = self._chunk_tokens.get(bench, PASSAGE_TOKENS)
        if tokens != PASSAGE_TOKENS:  # a re-chunked corpus never shares a store with the native one
            parts.append({"passage_tokens": tokens})
        if bench in self._corpus:  # another sample (--limit, --seed) or file under the same name: its own store,
            parts.append({"corpus": self._corpus[bench]})  # never one whose index also retrieves the other's passages
        key = json.dumps(parts, sort_keys=True)
        return str(Path(self.config.stores_dir) / f"{bench}-{hashlib.sha256(key.encode()).hexdigest()[:10]}")

    def _session(self, fuser: str | None):
        from cachegraft_cli.session import ModelChoice, ModelSession

        key = fuser or "closed"
        if key not in self._sessions:
            c = self.config
            session = ModelSession(ModelChoice(c.receiver, c.sharer, fuser or "closed", c.device, c.dtype))
            loaded = next((s.__dict__["receiver"] for s in self._sessions.values() if "receiver" in s.__dict__), None)
            if loaded is not None:  # one receiver in memory however many fusers (it is only read)
                session.__dict__["receiver"] = loaded
            if self._sessions:  # one sharer writes the notes whatever fuser fuses them: written once
                session.notes_written = next(iter(self._sessions.values())).notes_written
            self._sessions[key] = session
        return self._sessions[key]

    def passage_template(self):
        return self._session(self.config.fuser).template  # the tokenizer alone: no weights load

    def prepare(self, benchmark_name: str, passages: list[dict], max_passage_tokens: int = PASSAGE_TOKENS) -> None:
        from cachegraft_cli.corpus import Passage
        from cachegraft_cli.encoding.local import encode_corpus
        from cachegraft_cli.encoding.plan import EncodeOptions
        from cachegraft_cli.progress import EncodeProgress
        from cachegraft_cli.retrieval.stored import build_store_index
        from cachegraft_cli.store.target import Target

        rows = [Passage(p["id"], p.get("title", ""), p["text"]) for p in passages]
        self._chunk_tokens[benchmark_name] = max_passage_tokens
        self._corpus[benchmark_name] = corpus_fingerprint(rows)
        own = "cache" in self.systems
        for fuser, mismatched in self._roles():
            if len(self.stores_needed) > 1:  # stores of one corpus differ after fusion only: fuse it once
                session = self._session(fuser)
                if not isinstance(session.fusion(), ReusedFusion):
                    session.__dict__["_fusion"] = ReusedFusion(session.fusion())
            for settings in self.mismatched_needed if mismatched else self.stores_needed:
                url = self._store_url(benchmark_name, fuser, settings, mismatched)
                codec, keep, keep_by, notes = settings
                target = Target.open(url)
                options = EncodeOptions(codec, self.config.encode_batch_size, max_passage_tokens=max_passage_tokens,
                                        also_own_cache=own, keep=keep,
                                        keep_by=keep_by if keep < 1 else None, mismatched_sharer=mismatched,
                                        sharer_notes=notes,  # a store made by an earlier run keeps its calibration
                                        calibration=self._calibration(codec) if target.store is None else None)
                role = ", mismatched sharer" if mismatched else (", adapter" if fuser != self.config.fuser else "")
                what = f"{codec}, keep {keep:g}{role}" + (f", notes {notes}" if notes else "")
                with EncodeProgress(len(rows), f"encode {benchmark_name} ({what})") as bar:
                    encode_corpus(rows, target, self._session(fuser), options, progress=bar)
                build_store_index(url, self.config.index_kind)
        if "sharer-text" not in self.systems:
            self._release_sharers()

    def _calibration(self, codec: str) -> str | None:
        """A tc store's calibration: the one the main fuser ships, for its controls' stores too
        (the adapter's and the mismatched sharer's caches are coded with the same tables)."""
        from cachegraft_cli.encoding.calibration import shipped_file

        path = shipped_file(self.config.fuser) if codec == "tc" else None
        return str(path) if path else None

    def _release_sharers(self) -> None:
        """Answering reads stored caches: only `sharer-text` runs the sharer. Dropping it
        (and the encode runner that holds it) frees most of what a run keeps in memory
        for hours; the next benchmark's encode loads it again (cached properties)."""
        for session in self._sessions.values():
            session.__dict__.pop("sharer", None)
            session.__dict__.pop("_fusion", None)
        gc.collect()

    def _roles(self) -> list[tuple[str | None, bool]]:
        """The stores a benchmark needs, as (fuser, mismatched sharer): the main one always, the
        adapter's and the mismatched-sharer control's when their systems are asked for."""
        roles = [(self.config.fuser, False)]
        if "adapter" in self.systems:
            roles.append((self._fuser_for("adapter"), False))
        if "mismatched" in self.systems:
            roles.append((self.config.fuser, True))
        return roles

    def _asker(self, bench: str, system: str, store: dict | None = None):
        from cachegraft_cli.answering.ask import Asker

        fuser = self._fuser_for(system)
        settings = self.config.store_settings(store)
        mismatched = system == "mismatched"
        key = (bench, fuser or "closed", settings, mismatched)
        if key not in self._askers:
            self._askers[key] = Asker(self._store_url(bench, fuser, settings, mismatched),
                                      session=self._session(fuser))
        return self._askers[key]

    def options(self, label: str, k: int):
        """AskOptions of a system label (`text@order=retrieval`): the run's assembly plus the label's overrides."""
        from cachegraft_cli.answering.ask import AskOptions
        from cachegraft_cli.evaluation.variants import parse_variant
        from cachegraft_cli.lm.generation import GenerationOptions

        c, variant = self.config, parse_variant(label)
        settings = {"scheme": c.scheme, "order": c.order, "recompute": c.recompute, "blend": c.blend,
                    "blend_layer": c.blend_layer, **variant.assembly}
        return AskOptions(variant.system, max(k, 1), generation=GenerationOptions(c.max_new_tokens), **settings)

    def answer(self, benchmark_name: str, questions, system: str, k: int) -> list[dict]:
        from cachegraft_cli.evaluation.variants import parse_variant

        options = self.options(system, k)
        store = parse_variant(system).store
        system = options.system
        asker = self._asker(benchmark_name, system, store)
        asker.warm(system)
        if self.config.answer_batch > 1 and len(questions) > 1:
            try:
                return self._answer_batched(asker, questions, options)
            except NoPassagesError:
                pass  # one question retrieved nothing: answer this chunk one at a time, that one as a miss
        out = []
        for q in questions:
            before = asker.store.stats_bytes_read
            try:
                result = asker.ask(q.question, options)
            except NoPassagesError as exc:  # scored as a miss (empty answer, nothing retrieved); the run goes on
                result = {"answer": "", "passages": [], "timings": {}, "error": exc.message}
            result["stats"] = {"bytes_read": asker.store.stats_bytes_read - before}
            out.append(result)
        return out

    def _answer_batched(self, asker, questions, options) -> list[dict]:
        """The chunk decoded `answer_batch` at a time (Asker.ask_many). Bytes read are the
        chunk's, shared out evenly: the batch reads its caches together."""
        before = asker.store.stats_bytes_read
        results = asker.ask_many([q.question for q in questions], options, batch_size=self.config.answer_batch)
        share = (asker.store.stats_bytes_read - before) / max(len(results), 1)
        for result in results:
            result["stats"] = {"bytes_read": round(share)}
        return results

    def close_models(self) -> None:
        self._askers.clear()
        self._sessions.clear()
        gc.collect()


def corpus_fingerprint(passages) -> str:
    """The sha256 (first 16 hex digits) of a corpus's passages (id, title, text), in any order:
    what names an evaluation's stores besides the models and codec."""
    digest = hashlib.sha256()
    for p in sorted(passages, key=lambda p: p.id):
        digest.update(json.dumps([p.id, p.title, p.text]).encode())
    return digest.hexdigest()[:16]
