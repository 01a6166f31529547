"""Everything a run needs before its first step: models, template, data, items, caches."""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from cachegraft_cli.errors import TrainingError
from cachegraft_cli.training import data as data_mod, objectives
from cachegraft_cli.training.log import say


@dataclass
class TrainingSetup:
    """What a training run has ready before its first step (the loaded receiver, the items, the cache bank)."""

    receiver: object
    template: object
    sharer_geometry: object
    train_items: list
    val_items: list
    train_keys: list[str]
    val_keys: list[str]
    bank: object
    prefix: list  # batch-1 float32 receiver prefix KV
    precompute_seconds: float
    data_info: dict


def load_models(config):
    from cachegraft_cli.lm.models import load_causal_lm

    kw = dict(device=config.device or "cpu", dtype=config.model_dtype, trust_remote_code=config.trust_remote_code)
    receiver = load_causal_lm(config.receiver, **kw)
    sharer = load_sharer(config) if config.sharer_input == "model" else None
    for lm in (receiver, sharer):
        if lm is not None:
            lm.model.requires_grad_(False)
    return receiver, sharer, kw


def sharer_geometry(config, sharer):
    """The sharer's KV geometry; in zero mode read from its config alone (no weights load)."""
    if sharer is not None:
        return sharer.geometry
    from transformers import AutoConfig

    from cachegraft_cli.lm.kvcache import model_geometry
    from cachegraft_cli.lm.models import resolve_source

    source, gguf, _ = resolve_source(config.sharer)
    try:
        cfg = AutoConfig.from_pretrained(source, trust_remote_code=config.trust_remote_code,
                                         **({"gguf_file": gguf} if gguf else {}))
    except OSError as exc:
        raise TrainingError(f"Cannot read the sharer's config {config.sharer} ({exc}).",
                            "The adapter needs the sharer's geometry: give a local dir or reachable hub id.") from None
    return model_geometry(cfg)


def needs_alignment(receiver, sharer) -> bool:
    from cachegraft_cli.lm.align import same_vocabulary

    return sharer is not None and not same_vocabulary(receiver.tokenizer, sharer.tokenizer)


def template_for(config, receiver):
    from cachegraft_cli.lm.template import DEFAULT_INSTRUCTION, PromptTemplate

    return PromptTemplate.for_tokenizer(receiver.tokenizer, config.instruction or DEFAULT_INSTRUCTION)


def select_passages(config, template, dataset, val_dataset):
    """Tokenize, filter by length, split by passage (seeded), cap counts."""
    ids = {k: template.passage_ids(p.title, p.text) for k, p in dataset.passages.items()}
    if val_dataset is not None:
        ids.update({k: template.passage_ids(p.title, p.text) for k, p in val_dataset.passages.items()})
    ok = {k for k, v in ids.items() if 8 <= len(v) <= config.max_passage_tokens}
    with_q = {q.passage for q in dataset.questions} | (
        {q.passage for q in val_dataset.questions} if val_dataset else set()
    )
    if config.objective == "qa":
        ok &= with_q
    if val_dataset is None:
        train, val = data_mod.split_by_passage(
            [k for k in dataset.passages if k in ok], config.val_fraction, config.seed
        )
    else:
        train = sorted(k for k in dataset.passages if k in ok)
        random.Random(config.seed).shuffle(train)
        val = sorted(k for k in val_dataset.passages if k in ok)
        random.Random(config.seed + 1).shuffle(val)
    train = train[: config.max_passages] if config.max_passages else train
    val = val[: config.max_val_passages] if config.max_val_passages is not None else val
    if not train:
        raise TrainingError(
            f"No usable training passages (need {'questions and ' if config.objective == 'qa' else ''}"
            f"8..{config.max_passage_tokens} tokens).",
            "Raise --max-passage-tokens or give more data.",
        )
    return ids, train, val


def extend_ids_with_notes(config, sharer, template, passages, ids, keys, progress: bool) -> dict | None:
    """With --sharer-notes N: the sharer's notes on each passage in `keys`, and `ids[key]` re-made as
    passage + notes (what `encode --sharer-notes N` caches). Notes are kept in a file beside the
    cache bank (in OUT with --cache-dir none), so a resumed or repeated run, or the adapter run that
    follows a fuser's, reuses them. Returns what the training record says of them."""
    if not config.sharer_notes:
        return None
    import time

    from cachegraft_cli.store.rows import with_notes

    t0 = time.perf_counter()
    file = notes_file(config)
    notes = _saved_notes(file)
    todo = [k for k in keys if k not in notes]
    if todo:
        _write_notes(config, sharer, passages, todo, notes, file, progress)
    added = 0
    for k in keys:
        before = len(ids[k])
        ids[k] = template.passage_ids(passages[k].title, with_notes(passages[k].text, notes[k]))
        added += len(ids[k]) - before
    say(f"sharer notes: {len(keys)} passages ({len(todo)} written) in {time.perf_counter() - t0:.0f} s, "
        f"{added / max(1, len(keys)):.1f} tokens added per passage; kept in {file}")
    return {"tokens": config.sharer_notes, "passages": len(keys), "written": len(todo), "tokens_added": added,
            "tokens_added_per_passage": round(added / max(1, len(keys)), 1),
            "seconds": round(time.perf_counter() - t0, 1), "file": str(file)}


def notes_file(config):
    """Where a run's notes live: named by what they depend on (the request and token limit, the
    sharer and its dtype, the instruction), so runs that would write the same notes share them."""
    import hashlib
    import json

    from cachegraft_cli.encoding.notes import notes_identity

    identity = {**(notes_identity(config.sharer_notes) or {}), "sharer": config.sharer,
                "dtype": config.sharer_dtype or config.model_dtype, "instruction": config.instruction}
    name = "notes-" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16] + ".json"
    return (bank_root(config) or Path(config.out)) / name


def _saved_notes(file) -> dict:
    import json

    try:
        return dict(json.loads(file.read_text())["notes"]) if file.is_file() else {}
    except (ValueError, KeyError, TypeError):  # a torn file from an interrupted run: write the notes again
        return {}


def _write_notes(config, sharer, passages, todo, notes: dict, file, progress: bool) -> None:
    """Write the notes of `todo` into `notes`, 8 passages at a time, saving after each batch."""
    from cachegraft_cli.encoding.notes import write_notes
    from cachegraft_cli.lm.template import DEFAULT_INSTRUCTION
    from cachegraft_cli.store.location import Location

    writer = sharer if sharer is not None else load_sharer(config)
    folder = Location.from_url(str(file.parent))
    bar = _bar(len(todo), progress, "sharer notes")
    for start in range(0, len(todo), 8):
        batch = todo[start : start + 8]
        texts = [(passages[k].title, passages[k].text) for k in batch]
        notes.update(zip(batch, write_notes(writer, config.instruction or DEFAULT_INSTRUCTION, texts,
                                            config.sharer_notes)))
        folder.write_json_atomic(file.name, {"notes": notes})
        if bar:
            bar.update(len(batch))
    if bar:
        bar.close()


def load_sharer(config):
    """The sharer in its dtype (an adapter run loads it only to write its notes)."""
    from cachegraft_cli.lm.models import load_causal_lm

    return load_causal_lm(config.sharer, device=config.device or "cpu",
                          dtype=config.sharer_dtype or config.model_dtype, trust_remote_code=config.trust_remote_code)


def bank_root(config):
    """The folder of the cache bank and the notes (None with --cache-dir none: nothing kept)."""
    from cachegraft_cli.config import cache_dir

    return None if config.cache_dir == "none" else Path(config.cache_dir or (cache_dir() / "train-caches"))


def build_items(config, template, ids, keys, questions, passages):
    """Items of one split; a qa item's past is assembled as `ask` would (see objectives.with_passages)."""
    lengths = {k: len(ids[k]) for k in keys}
    if config.objective != "qa":
        return objectives.lm_items({k: ids[k] for k in keys}, config.lm_fused_fraction, config.lm_target_tokens)
    questions = [q for q in questions if q.passage in lengths]
    items = objectives.qa_items(questions, template, lengths, config.max_answer_tokens)
    depth = max(config.passages_per_item)
    ranked = None
    if config.distractors == "retrieved" and depth > 1:
        ranked = rank_passages(questions, [passages[k] for k in keys], depth)
    items = objectives.with_passages(items, list(keys), lengths, config.passages_per_item, config.seed, ranked,
                                     config.order)
    return objectives.with_recompute(items, ids, config.recompute)


def rank_passages(questions, passages, depth: int) -> list[list[str]]:
    """Per question, the keys of the `depth` passages BM25 ranks first (the index `ask` uses by default)."""
    from cachegraft_cli.retrieval.index import Doc, build_index

    index = build_index([Doc(p.key, p.text, p.title) for p in passages], "bm25", progress=False)
    return [[h.id for h in hits] for hits in index.search_many([q.question for q in questions], depth)]


def without_holdout(config, dataset):
    """The data minus every passage (and its questions) of the corpora `evaluate -B SPEC` would use,
    so a fuser is never trained on what it is evaluated on. Returns (dataset, passages removed)."""
    if not config.holdout:
        return dataset, 0
    from cachegraft_cli.errors import CacheGraftError
    from cachegraft_cli.evaluation.datasets import load_benchmark

    held = set()
    for spec in config.holdout:
        try:
            bench = load_benchmark(spec, seed=config.holdout_seed)
        except CacheGraftError as exc:
            raise TrainingError(f"--holdout {spec}: {exc.message}", exc.hint) from None
        held |= {p.text.strip() for p in bench.passages}
    keep = {k for k, p in dataset.passages.items() if p.text.strip() not in held}
    return dataset.subset(keep), len(dataset.passages) - len(keep)


def cap_items(items, limit, seed):
    if limit is None or len(items) <= limit:
        return items
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in sorted(order[:limit])]


def fill_bank(config, receiver, sharer, template, fuser, ids, keys, progress: bool):
    import time

    from cachegraft_cli.encoding.notes import notes_identity
    from cachegraft_cli.fuser.fusion import PassageFusion
    from cachegraft_cli.training.precompute import CacheBank, bank_identity

    t0 = time.perf_counter()
    engine = PassageFusion(receiver, template.prefix_ids(), sharer, fuser)
    identity = bank_identity(receiver, sharer, template, config.cache_dtype, notes_identity(config.sharer_notes))
    bank = CacheBank(identity, config.cache_dtype, bank_root(config))
    bar = _bar(len(bank.missing(keys)), progress, "precompute caches")
    computed = bank.fill(engine, {k: ids[k] for k in keys}, batch_size=4,
                         progress=(lambda n, t: bar.update(n)) if bar else None)
    if bar:
        bar.close()
    prefix = [(k.float().unsqueeze(0), v.float().unsqueeze(0)) for k, v in engine.prefix_kv()]
    engine.sharer = None
    del engine
    gc.collect()
    say(f"caches: {len(keys)} passages ({computed} computed, {len(keys) - computed} reused) in "
        f"{time.perf_counter() - t0:.0f} s{f'; stored under {bank.dir}' if bank.dir else ''}")
    return bank, prefix, time.perf_counter() - t0


def _bar(total, enabled, what: str):
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="passage", file=sys.stderr, dynamic_ncols=True)


def free(model) -> None:
    del model
    gc.collect()
    torch.set_grad_enabled(True)
