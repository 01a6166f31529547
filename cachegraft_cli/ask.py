"""Answer questions from a store: retrieve -> load caches -> assemble -> generate.

Systems (docs/method.md section 3; names in `systems.py`), all with the same template and ids:
- graft: the receiver with fused passage caches (no sharer is loaded);
- adapter: the same, from a store encoded with an adapter fuser (trained with
  the sharer's input zeroed): isolates task adaptation from the sharer;
- cache: the receiver with its own stored passage caches (`encode --also-own-cache`);
- text: the receiver with the passages pasted as text;
- closed: the receiver with no passages;
- sharer-text: the sharer with the passages as text (reference ceiling).

Position schemes for stored caches: `rotate` places passages one after another
and re-rotates each key block by its offset; `shared` keeps every passage at
its canonical positions and starts the question after the longest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from cachegraft_cli.errors import NoPassagesError, UsageError
from cachegraft_cli.generation import GenerationConfig
from cachegraft_cli.systems import CACHE_KIND, SYSTEMS, check_name, check_question

__all__ = ["SYSTEMS", "AskOptions", "Asker"]

SCHEMES = ("rotate", "shared")
DEFAULT_SCHEME = "rotate"


@dataclass
class AskOptions:
    system: str = "graft"
    k: int = 3
    scheme: str = DEFAULT_SCHEME
    generation: GenerationConfig = field(default_factory=GenerationConfig)

    def check(self) -> None:
        check_name(self.system)
        if self.scheme not in SCHEMES:
            raise UsageError(f"Unknown position scheme {self.scheme!r}.", f"Choose one of: {', '.join(SCHEMES)}.")


class Asker:
    """Holds the store, the index and the models across questions (load once)."""

    def __init__(self, store_url: str, overrides=None, index_kind: str | None = None, session=None):
        """`session` reuses already loaded models (checked against the store's receiver)."""
        from cachegraft_cli.session import session_for_store
        from cachegraft_cli.store import CacheStore

        self.store = CacheStore.open(store_url)
        self.store_url = store_url
        if len(self.store) == 0:
            raise NoPassagesError(f"Store {store_url} has no passages.",
                                  f"Run `cachegraft encode CORPUS --store {store_url}` first.")
        self.session = session or session_for_store(self.store, overrides)
        self.index_kind = index_kind

    @cached_property
    def index(self):
        from cachegraft_cli.indexing import open_index

        return open_index(self.store, self.store_url, self.index_kind)

    @cached_property
    def receiver(self):
        from cachegraft_cli.session import check_receiver

        check_receiver(self.store, self.session)
        return self.session.receiver

    @cached_property
    def _prefix(self):
        from cachegraft_cli import kvcache

        r = self.receiver
        return kvcache.from_token_major(self.store.prefix(), r.dtype, r.device)

    @cached_property
    def _rotator(self):
        from cachegraft_cli.kvcache import KeyRotator

        return KeyRotator.for_model(self.receiver.model)

    def warm(self, system: str) -> None:
        """Load the index and the models a system needs, so timings cover answering only."""
        loaded = [self.index] if system != "closed" else []  # cached properties: touching them loads them
        loaded.append(self.session.sharer if system == "sharer-text" else self.receiver)
        if system in CACHE_KIND:
            loaded += [self._prefix, self._rotator]

    def check_system(self, system: str) -> None:
        """Refuse a system this store cannot serve (`systems.check_system`)."""
        from cachegraft_cli.systems import check_system

        check_system(self.store, system)

    def ask(self, question: str, options: AskOptions, on_text: Callable[[str], None] | None = None) -> dict:
        options.check()
        self.check_system(options.system)
        check_question(question)
        t0 = time.perf_counter()
        hits = self.retrieve(question, options.k) if options.system != "closed" else []
        t_retrieve = time.perf_counter()
        gen, t_load = self._generate(question, hits, options, on_text, t0)
        timings = {"retrieve": t_retrieve - t0, "load": t_load - t_retrieve, **gen.timings}
        return _result(question, gen, hits, self.store.get_rows([h.id for h in hits]), options, timings)

    def retrieve(self, question: str, k: int):
        hits = self.index.search(question, k)
        if not hits:
            raise NoPassagesError(
                f"No passage matched the question {question!r}.",
                "Rephrase it with words from the corpus, raise -k, or use a dense index (`cachegraft index --kind "
                "dense`).",
            )
        return hits

    def _generate(self, question, hits, options: AskOptions, on_text, t0):
        from cachegraft_cli.generation import generate

        lm, past, ids, start = self._prompt(question, hits, options)
        t_load = time.perf_counter()
        return generate(lm, past, ids, start, options.generation, on_text, t0), t_load

    def _prompt(self, question: str, hits, options: AskOptions):
        """(model, past KV or None, input ids, first position) for one question."""
        if options.system in CACHE_KIND:
            past, start = self._assemble([h.id for h in hits], CACHE_KIND[options.system], options.scheme)
            return self.receiver, past, self.session.template.question_ids(question), start
        lm, template = self._text_model(options.system)
        rows = self.store.get_rows([h.id for h in hits])
        ids = template.prefix_ids() + [i for r in rows for i in template.passage_ids(r.title, r.text)]
        return lm, None, ids + template.question_ids(question), 0

    def ask_many(self, questions: list[str], options: AskOptions, batch_size: int = 8) -> list[dict]:
        """Answer questions in batches of `batch_size` (one batched decode each);
        timings are per batch, shared by its questions."""
        from cachegraft_cli.generation import generate_batch

        options.check()
        self.check_system(options.system)
        results = []
        for i in range(0, len(questions), batch_size):
            chunk = questions[i : i + batch_size]
            t0 = time.perf_counter()
            hit_lists = self._retrieve_many(chunk, options)
            t_retrieve = time.perf_counter()
            prompts = [self._prompt(q, hits, options) for q, hits in zip(chunk, hit_lists)]
            t_load = time.perf_counter()
            gens = generate_batch(prompts[0][0], [p[1] for p in prompts], [p[2] for p in prompts],
                                  [p[3] for p in prompts], options.generation)
            for q, hits, gen in zip(chunk, hit_lists, gens):
                timings = {"retrieve": t_retrieve - t0, "load": t_load - t_retrieve,
                           **{k: v + (t_load - t0) for k, v in gen.timings.items() if k != "prefill"},
                           "prefill": gen.timings["prefill"]}
                results.append(_result(q, gen, hits, self.store.get_rows([h.id for h in hits]), options, timings))
        return results

    def _retrieve_many(self, questions: list[str], options: AskOptions):
        if options.system == "closed":
            return [[] for _ in questions]
        hit_lists = self.index.search_many(questions, options.k)
        for q, hits in zip(questions, hit_lists):
            if not hits:
                self.retrieve(q, options.k)  # raises the no-passage error for this question
        return hit_lists

    def _text_model(self, system: str):
        if system == "sharer-text":
            from cachegraft_cli.template import PromptTemplate

            sharer = self.session.sharer
            return sharer, PromptTemplate.for_tokenizer(sharer.tokenizer, self.session.choice.instruction)
        return self.receiver, self.session.template

    def _assemble(self, ids: list[str], kind: str, scheme: str):
        """Batched past KV (prefix + passages) and the question's first position."""
        from cachegraft_cli import kvcache

        if kind not in self.store.kinds:
            raise UsageError(
                f"Store {self.store_url} has no {kind!r} caches (it holds {', '.join(self.store.kinds)}).",
                "Re-encode with `cachegraft encode --also-own-cache` into a new store to compare with the `cache` "
                "system.",
            )
        r = self.receiver
        arrays = self.store.read(ids, kind=kind)
        base = kvcache.num_tokens(self._prefix)
        parts, position = [self._prefix], base
        for array in arrays:
            kv = kvcache.from_token_major(array, r.dtype, r.device)
            if scheme == "rotate":
                kv = self._rotator.rotate(kv, position - base)
                position += len(array)
            parts.append(kv)
        if scheme == "shared":
            position = base + max(len(a) for a in arrays)
        return kvcache.batched(kvcache.concat_tokens(parts)), position


def _result(question: str, gen, hits, rows, options: AskOptions, timings: dict) -> dict:
    return {
        "question": question,
        "answer": gen.text,
        "passages": [{"id": h.id, "title": row.title, "score": round(float(h.score), 4)} for h, row in zip(hits, rows)],
        "system": options.system,
        "k": options.k,
        "scheme": options.scheme if options.system in CACHE_KIND else None,
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "tokens": {"prompt": gen.prompt_tokens, "generated": len(gen.token_ids)},
    }
