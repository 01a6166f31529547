"""Answer questions from a store: retrieve -> load caches -> assemble -> generate.

Systems (docs/method.md section 3; names in `systems.py`), all with the same template and ids:
- graft: the receiver with fused passage caches (no sharer is loaded);
- adapter: the same, from a store encoded with an adapter fuser (trained with
  the sharer's input zeroed): isolates task adaptation from the sharer;
- cache: the receiver with its own stored passage caches (`encode --also-own-cache`);
- text: the receiver with the passages pasted as text;
- closed: the receiver with no passages;
- sharer-text: the sharer with the passages as text (reference ceiling).

How stored caches are put together (passage order, position scheme, boundary
and selective recompute) is `assembly.py`; the order applies to the text
systems too.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable

from cachegraft_cli.answering.assembly import (
    DEFAULT_SCHEME,
    ORDERS,
    SCHEMES,
    in_prompt_order,
)
from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.answering.systems import CACHE_KIND, SYSTEMS
from cachegraft_cli.errors import NoPassagesError, StoreMismatchError, UsageError
from cachegraft_cli.lm.generation import Prompt, RowStreams

__all__ = ["SYSTEMS", "ORDERS", "SCHEMES", "DEFAULT_SCHEME", "AskOptions", "Asker", "Prepared", "PromptPlan"]


class Asker:
    """Holds the store, the index and the models across questions (load once)."""

    def __init__(self, store_url: str, overrides=None, index_kind: str | None = None, session=None):
        """`overrides`: a `session.ModelOverrides`; `session` reuses already loaded models (checked
        against the store's receiver)."""
        from cachegraft_cli.session import session_for_store
        from cachegraft_cli.store import CacheStore

        self.store = CacheStore.open(store_url, partial=True)  # a lost segment: answer from the others
        self.store_url = store_url
        if len(self.store) == 0:
            raise NoPassagesError(f"Store {store_url} has no passages.",
                                  f"Run `cachegraft encode CORPUS --store {store_url}` first.")
        self.session = session or session_for_store(self.store, overrides)
        self.index_kind = index_kind
        self._planned: dict[tuple, PromptPlan] = {}  # `check_fits`' plans, spent when their question is answered

    @cached_property
    def index(self):
        from cachegraft_cli.retrieval.stored import open_index

        return open_index(self.store, self.store_url, self.index_kind)

    @cached_property
    def receiver(self):
        from cachegraft_cli.session import check_receiver

        check_receiver(self.store, self.session)
        return self.session.receiver

    @cached_property
    def _assembler(self):
        from cachegraft_cli.answering.assembly import Assembler
        from cachegraft_cli.lm import kvcache

        r = self.receiver
        return Assembler(r, kvcache.from_token_major(self.store.prefix(), r.dtype, r.device))

    def warm(self, system: str) -> None:
        """Load the index and the models a system needs, so timings cover answering only."""
        loaded = [self.index] if system != "closed" else []  # cached properties: touching them loads them
        loaded.append(self.session.sharer if system == "sharer-text" else self.receiver)
        if system in CACHE_KIND:
            loaded.append(self._assembler)

    def check_system(self, system: str) -> None:
        """Refuse a system this store cannot serve (`systems.check_system`)."""
        from cachegraft_cli.answering.systems import check_system

        check_system(self.store, system)

    def check_options(self, options: AskOptions) -> None:
        """Refuse checked `options` this store cannot be asked with, from its metadata alone (no
        model loads): the system (`check_system`) and, for a blend over stored caches, a
        `blend_layer` the receiver has (the store's geometry counts its layers)."""
        from cachegraft_cli.answering.assembly import check_blend_layer

        self.check_system(options.system)
        if options.system in CACHE_KIND:
            check_blend_layer(options.assembly, self.store.identity["geometry"]["layers"])

    def notes(self, system: str) -> list[str]:
        """What is worth saying before asking with `system`: a closed fuser, an index that misses passages."""
        from cachegraft_cli.retrieval.stored import coverage_note

        out = []
        if system == "graft" and self.store.identity.get("fuser") is None:
            out.append("note: this store was encoded with the fuser closed, "
                       "so `graft` answers from the receiver's own caches (the `cache` system).")
        coverage = coverage_note(self.store, self.index, self.store_url) if system != "closed" else None
        if coverage:
            out.append(f"warning: {coverage}")
        return out

    def ask(self, question: str, options: AskOptions, on_text: Callable[[str], None] | None = None,
            cancelled: Callable[[], bool] | None = None) -> dict:
        """One question (checked by the caller); `on_text` hears the answer as it is decoded,
        `cancelled()` true stops it early."""
        from cachegraft_cli.lm.generation import generate

        prepared = self._prepare(question, options)
        gen = generate(prepared.lm, prepared.prompt, options.generation, on_text, prepared.started, cancelled)
        return prepared.result(gen)

    def prepare(self, question: str, options: AskOptions) -> "Prepared":
        """Everything before decoding: the store's checks of `options`, retrieval, the caches
        loaded into a prompt (serving's entry: each request brings its own options)."""
        self.check_options(options)
        return self._prepare(question, options)

    def _prepare(self, question: str, options: AskOptions) -> "Prepared":
        t0 = time.perf_counter()
        plan = self._planned.pop(_plan_key(question, options), None)
        if plan is None:
            hits = self.retrieve(question, options.k) if options.system != "closed" else []
            searched, started, t_search = time.perf_counter() - t0, t0, time.perf_counter()
            plan = self.plan(question, hits, options)
        else:  # planned by `check_fits`: its retrieval counts as if it were now
            searched, started, t_search = plan.seconds, t0 - plan.seconds, t0
        lm, prompt = self.prompt_of(plan, options)
        load = time.perf_counter() - t_search
        return Prepared(question, options, plan.hits, plan.rows, lm, prompt, started,
                        {"retrieve": searched, "load": load})

    def check_fits(self, questions: list[str], options: AskOptions) -> None:
        """Refuse a question whose prompt would reach past the model's context window, before any
        model loads: the window from the model's config.json, the stored passages' lengths from the
        store's rows, the prompt's other tokens from the tokenizer alone. A bound from the rows
        alone comes first, so a plain overflow (`--max-new-tokens 100000`) is refused without even
        the tokenizer. The loaded model is checked again when the prompt is built
        (`_check_context`). A question that retrieves nothing is checked without passages (a lower
        bound) and left to fail when it is answered. The plans are kept for answering the questions."""
        from cachegraft_cli.lm.models import configured_window

        spec = self.session.choice.sharer if options.system == "sharer-text" else self.session.choice.receiver
        window = configured_window(spec) if spec else None
        if spec is None or window is None:  # no sharer named: `sharer-text` says so when it loads
            return
        t0 = time.perf_counter()
        closed = options.system == "closed"
        hit_lists = [[] for _ in questions] if closed else self.index.search_many(questions, self.search_k(options.k))
        row_lists = [self.store.get_rows([h.id for h in hits]) for hits in hit_lists]
        seconds = (time.perf_counter() - t0) / max(1, len(questions))
        new_tokens = options.generation.max_new_tokens
        if options.system != "sharer-text":  # the store's rows count the receiver's tokens only
            for rows in row_lists:
                check_window(spec, window, self.least_end(rows, options), new_tokens, at_least=True)
        template = self.planned_template(options.system)
        for question, hits, rows in zip(questions, hit_lists, row_lists):
            plan = self.plan(question, hits, options, template, rows)
            check_window(spec, window, plan.end, new_tokens)
            if hits or closed:  # a question that retrieved nothing fails when it is answered
                self._planned[_plan_key(question, options)] = replace(plan, seconds=seconds)

    def planned_template(self, system: str):
        """The prompt template of the model answering `system`, built from its tokenizer alone."""
        if system != "sharer-text":
            return self.session.template
        if "sharer" in self.session.__dict__:  # loaded: its own tokenizer
            return self._text_model(system)[1]
        from cachegraft_cli.lm.models import load_tokenizer
        from cachegraft_cli.lm.template import PromptTemplate

        choice = self.session.choice
        tokenizer = load_tokenizer(choice.sharer or "", trust_remote_code=choice.trust_remote_code)
        return PromptTemplate.for_tokenizer(tokenizer, choice.instruction)

    def least_end(self, rows, options: AskOptions) -> int:
        """A lower bound of a plan's end from the hits' rows alone (no tokenizer): the prefix, the
        stored passages' spans (stored-cache systems; text re-tokenizes them) and one question token."""
        prefix = len(self.store.prefix_token_ids)
        if options.system not in CACHE_KIND or not rows:
            return prefix + 1
        return prefix + _extent([_span(r) for r in rows], options.scheme) + 1

    def plan(self, question: str, hits, options: AskOptions, template=None, rows=None) -> PromptPlan:
        """The prompt of `question` over `hits` (rank order) laid out once: `rows` are the hits'
        rows (fetched here when not given), `template` the answering model's (default: its own)."""
        template = template if template is not None else self.planned_template(options.system)
        rows = rows if rows is not None else self.store.get_rows([h.id for h in hits])
        in_prompt = in_prompt_order(rows, options.order)
        question_ids = template.question_ids(question)
        kind = CACHE_KIND.get(options.system)
        if kind is not None:
            return PromptPlan(options.system, kind, options.scheme, options.order, list(hits), rows,
                              list(self.store.prefix_token_ids),
                              [r.tokens for r in in_prompt], [_span(r) for r in in_prompt], question_ids)
        passage_ids = [template.passage_ids(r.title, r.read_text) for r in in_prompt]
        lengths = [len(p) for p in passage_ids]
        return PromptPlan(options.system, None, options.scheme, options.order, list(hits), rows,
                          template.prefix_ids(), lengths, lengths, question_ids, passage_ids)

    def search_k(self, k: int) -> int:
        """How many hits to ask the index for: `k`, but never more than the store holds. A search
        engine sizes its buffers by k before it looks (tantivy aborts the process on -k 2147483647),
        and no store has more distinct passages to return."""
        return max(1, min(k, len(self.store)))

    def retrieve(self, question: str, k: int):
        hits = self.index.search(question, self.search_k(k))
        if not hits:
            raise NoPassagesError(
                f"No passage matched the question {question!r}.",
                "Rephrase it with words from the corpus, raise -k, or use a dense index (`cachegraft index --kind "
                "dense`).",
            )
        return hits

    def build_prompt(self, question: str, hits, options: AskOptions) -> tuple[object, Prompt]:
        """(model, prompt) for one question; `hits` in retrieval rank order."""
        return self.prompt_of(self.plan(question, hits, options), options)

    def prompt_of(self, plan: PromptPlan, options: AskOptions) -> tuple[object, Prompt]:
        """(model, prompt) of a plan: the stored caches assembled, or the planned ids."""
        if plan.kind is not None:
            lm, prompt = self.receiver, self._assemble(plan, options)
        else:
            lm = self._text_model(options.system)[0]
            tokens = plan.prefix_ids + [i for ids in plan.passage_ids for i in ids]
            prompt = Prompt.plain(None, tokens + plan.question_ids, 0)
        _check_context(lm, prompt, options.generation.max_new_tokens)
        return lm, prompt

    def ask_many(self, questions: list[str], options: AskOptions, batch_size: int = 8,
                 streams: RowStreams | None = None) -> list[dict]:
        """Answer questions (checked by the caller) in batches of `batch_size` (one batched decode
        each); `streams` (one entry per question) hears each answer as it is decoded and can stop one.

        Timings: `load` (reading and assembling the question's caches) is the
        question's own; what the batch does at once (retrieval, the batched
        prefill and decode) is under `batch`, the same for every question of it."""
        from cachegraft_cli.lm.generation import generate_batch

        results = []
        for i in range(0, len(questions), batch_size):
            chunk = questions[i : i + batch_size]
            t0 = time.perf_counter()
            plans, ahead = self._plan_many(chunk, options)
            t0 -= ahead  # the plans `check_fits` made retrieved then: that time counts as if it were now
            t_retrieve = time.perf_counter()
            prompts, loads = [], []
            for plan in plans:
                start = time.perf_counter()
                prompts.append(self.prompt_of(plan, options))
                loads.append(time.perf_counter() - start)
            for q in chunk:  # answered from here on: the plans made before are spent
                self._planned.pop(_plan_key(q, options), None)
            t_load = time.perf_counter()
            window = _window(streams, i, len(chunk))
            gens = generate_batch(prompts[0][0], [p for _, p in prompts], options.generation, window)
            first = gens[0].timings
            shared = {"questions": len(chunk), "retrieve": t_retrieve - t0, "load": t_load - t_retrieve,
                      "prefill": first["prefill"], "first_token": t_load - t0 + first["first_token"],
                      "total": t_load - t0 + first["total"]}
            for q, plan, (_, prompt), gen, load in zip(chunk, plans, prompts, gens, loads):
                timings = {"load": load, "batch": {k: round(v, 4) for k, v in shared.items()}}
                results.append(_result(q, gen, prompt, plan.hits, plan.rows, options, timings))
        return results

    def _plan_many(self, questions: list[str], options: AskOptions) -> tuple[list[PromptPlan], float]:
        """The questions' plans: those `check_fits` made (and the seconds they took then), the
        others retrieved and planned now."""
        plans = [self._planned.get(_plan_key(q, options)) for q in questions]
        ahead = sum(p.seconds for p in plans if p is not None)
        todo = [q for q, p in zip(questions, plans) if p is None]
        hit_lists = self._retrieve_many(todo, options) if todo else []
        made = {q: self.plan(q, hits, options) for q, hits in zip(todo, hit_lists)}
        return [p if p is not None else made[q] for q, p in zip(questions, plans)], ahead

    def _retrieve_many(self, questions: list[str], options: AskOptions):
        if options.system == "closed":
            return [[] for _ in questions]
        hit_lists = self.index.search_many(questions, self.search_k(options.k))
        for q, hits in zip(questions, hit_lists):
            if not hits:
                self.retrieve(q, options.k)  # raises the no-passage error for this question
        return hit_lists

    def _text_model(self, system: str):
        if system == "sharer-text":
            from cachegraft_cli.lm.template import PromptTemplate

            sharer = self.session.sharer
            return sharer, PromptTemplate.for_tokenizer(sharer.tokenizer, self.session.choice.instruction)
        return self.receiver, self.session.template

    def _assemble(self, plan: PromptPlan, options: AskOptions) -> Prompt:
        """The prompt over the plan's stored caches: past, recomputed tokens, question."""
        kind = plan.kind
        if kind not in self.store.kinds:
            raise UsageError(
                f"Store {self.store_url} has no {kind!r} caches (it holds {', '.join(self.store.kinds)}).",
                "Re-encode with `cachegraft encode --also-own-cache` into a new store to compare with the `cache` "
                "system.",
            )
        ids = plan.ids
        arrays = self.store.read(ids, kind=kind)
        kept = self.store.positions(ids)  # a pruned store's tokens keep their positions in the passage
        assembly = options.assembly
        needs_ids = len(ids) > 1 and (assembly.recompute > 0 or assembly.blend > 0)
        passage_ids = self._passage_ids(plan.prompt_rows, arrays, kept) if needs_ids else []
        prompt = self._assembler.prompt(arrays, passage_ids, plan.question_ids, assembly, kept)
        # the ids greedy answers copy drafts from (`lm/drafting.py`): the passages' own when
        # recompute or blend tokenized them already, else re-tokenized once the first token is out
        prompt.source = functools.partial(self._draft_source, plan, passage_ids)
        return prompt

    def _draft_source(self, plan: PromptPlan, passage_ids: list[list[int]]) -> list[int]:
        """The passages' tokens in prompt order, then the question's (the caches hold no ids)."""
        template = self.session.template
        passages = passage_ids or [template.passage_ids(row.title, row.read_text) for row in plan.prompt_rows]
        return [t for ids in passages for t in ids] + list(plan.question_ids)

    def _passage_ids(self, rows, arrays, kept) -> list[list[int]]:
        """Token ids of the stored passages (re-tokenized), checked against their lengths before pruning."""
        template = self.session.template
        out = []
        for row, array, k in zip(rows, arrays, kept):
            tokens = template.passage_ids(row.title, row.read_text)
            if len(tokens) != (len(array) if k is None else k[1]):
                raise StoreMismatchError(
                    f"Passage {row.id!r} tokenizes to {len(tokens)} tokens but its cache was made from "
                    f"{len(array) if k is None else k[1]}.",
                    "The tokenizer differs from the one the store was encoded with; "
                    "ask with --recompute 0, or re-encode.",
                )
            out.append(tokens)
        return out


@dataclass
class PromptPlan:
    """One question's prompt laid out once, from its hits' rows fetched once: what `check_fits`
    measures and what `build_prompt` assembles, so the two cannot disagree.

    Passages are in prompt order (`order` applied). A stored-cache system (`kind`) reads each
    passage's stored tokens (`lengths` slots) at the positions it spans (`spans`: a pruned
    passage's tokens before pruning), one after another (`rotate`) or each from the prefix's end
    (`shared`); a text system pastes `passage_ids` after `prefix_ids`."""

    system: str
    kind: str | None  # the stored caches read (`systems.CACHE_KIND`); None: passages as text, or none
    scheme: str
    order: str
    hits: list  # retrieval rank order
    rows: list  # the hits' rows, rank order
    prefix_ids: list[int]
    lengths: list[int]  # per passage: its slots in the prompt
    spans: list[int]  # per passage: the positions it spans
    question_ids: list[int]
    passage_ids: list[list[int]] = field(default_factory=list)  # text systems: the pasted ids
    seconds: float = 0.0  # its share of the retrieval and row reads that made it, ahead of answering

    @property
    def ids(self) -> list[str]:
        """The passages' ids in prompt order."""
        return [h.id for h in in_prompt_order(self.hits, self.order)]

    @property
    def prompt_rows(self) -> list:
        return in_prompt_order(self.rows, self.order)

    @property
    def end(self) -> int:
        """The position after the prompt's last token (`Prompt.end_position` of the built prompt)."""
        spans = _extent(self.spans, self.scheme) if self.kind is not None else sum(self.spans)
        return len(self.prefix_ids) + spans + len(self.question_ids)


def _plan_key(question: str, options: AskOptions) -> tuple:
    """What a plan depends on: the question, what is retrieved, which prompt reads it and how."""
    return question, options.system, options.k, options.order, options.scheme


def _span(row) -> int:
    """The positions a stored passage spans (a pruned one: its tokens before pruning)."""
    return row.span_tokens if row.span_tokens is not None else row.tokens


def _extent(spans: list[int], scheme: str) -> int:
    """Positions the passages take: one after another (`rotate`), or the longest (`shared`)."""
    if not spans:
        return 0
    return max(spans) if scheme == "shared" else sum(spans)


@dataclass
class Prepared:
    """A question ready to decode (`Asker.prepare`): its model and prompt, what was retrieved,
    and when its request started (so `first_token` covers retrieval and loading)."""

    question: str
    options: AskOptions
    hits: list
    rows: list
    lm: Any
    prompt: Prompt
    started: float
    timings: dict

    def result(self, gen) -> dict:
        """What `ask --json` prints for this question, answered by `gen`."""
        return _result(self.question, gen, self.prompt, self.hits, self.rows, self.options,
                       {**self.timings, **gen.timings})


def _window(streams: RowStreams | None, start: int, n: int) -> RowStreams | None:
    """The rows of `streams` that one batch of `n` questions from `start` decodes."""
    if streams is None:
        return None
    stopped = streams.stopped
    return RowStreams(streams.on_text[start : start + n], lambda row: stopped(start + row))


def _check_context(lm, prompt: Prompt, max_new_tokens: int) -> None:
    """Refuse a prompt the model cannot place: RoPE positions beyond its window."""
    from cachegraft_cli.lm.models import context_window

    window = context_window(lm)
    if window is not None:
        check_window(lm.spec, window, prompt.end_position, max_new_tokens)


def check_window(spec: str, window: int, end_position: int, max_new_tokens: int, at_least: bool = False) -> None:
    """`at_least`: `end_position` is a lower bound (the message says "or more")."""
    need = end_position + max_new_tokens
    more = " or more" if at_least else ""
    if need > window:
        raise UsageError(
            f"The prompt reaches position {end_position}{more} and --max-new-tokens adds {max_new_tokens}: "
            f"{need}{more} positions, but {spec} has a context window of {window}.",
            "Lower -k (fewer passages) or --max-new-tokens.",
        )


def _result(question: str, gen, prompt: Prompt, hits, rows, options: AskOptions, timings: dict) -> dict:
    stored = options.system in CACHE_KIND
    return {
        "question": question,
        "answer": gen.text,
        "passages": [{"id": h.id, "title": row.title, "score": round(float(h.score), 4)} for h, row in zip(hits, rows)],
        "system": options.system,
        "k": options.k,
        "order": options.order if hits else None,
        "scheme": options.scheme if stored else None,
        "recompute": {"tokens": options.recompute, "blend": options.blend} if stored else None,
        "timings": {k: round(v, 4) if isinstance(v, float) else v for k, v in timings.items()},
        "tokens": {"prompt": gen.prompt_tokens, "recomputed": prompt.recomputed, "generated": len(gen.token_ids)},
    }
