"""One prompt plan per question: the lengths `check_fits` measures are the assembled prompt's,
for every system, position scheme and order, pruned stores included; and an ask reads each
passage's row once, its checks before loading included."""

from collections import Counter

import pytest

from cachegraft_cli.answering.systems import SYSTEMS

QUESTION = "who built the harbor lighthouse?"
CHECKED_SYSTEMS = ("graft", "cache", "text", "closed", "sharer-text")  # adapter/mismatched: graft's plan (fused)


@pytest.fixture(scope="module")
def stores(tiny_dirs, tmp_path_factory):
    """A store with fused and own caches, and a pruned one (`keep=0.5`), of the tiny receiver."""
    import cachegraft_cli as cg

    words = "harbor lighthouse fishermen founded town river bank"
    passages = [{"id": f"p{i}", "title": f"Harbor {i}" if i % 2 else "", "text": f"Passage {i}: {words[: 20 + 5 * i]}."}
                for i in range(6)]
    out = {}
    for name, keep in (("whole", None), ("pruned", 0.5)):
        path = tmp_path_factory.mktemp(name) / "store"
        cg.encode(passages, path, models=cg.Models(receiver=str(tiny_dirs["receiver"]), dtype="float32"),
                  options=cg.EncodeOptions(also_own_cache=True, keep=keep))
        cg.index(path)
        out[name] = str(path)
    return out


def _asker(url, tiny_dirs):
    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.session import ModelOverrides

    return Asker(url, ModelOverrides(sharer=str(tiny_dirs["sharer_other"]), device="cpu", dtype="float32").check())


def test_every_system_the_plan_covers_is_checked_here():
    from cachegraft_cli.answering.systems import CACHE_KIND

    # the other stored-cache systems read the same kind of caches as graft, through the same plan
    assert set(SYSTEMS) - set(CHECKED_SYSTEMS) == {"adapter", "mismatched"}
    assert CACHE_KIND["adapter"] == CACHE_KIND["mismatched"] == CACHE_KIND["graft"]


@pytest.mark.parametrize("store", ["whole", "pruned"])
@pytest.mark.parametrize("system", CHECKED_SYSTEMS)
def test_the_plans_lengths_are_the_assembled_prompts(stores, tiny_dirs, store, system):
    from cachegraft_cli.answering.ask import AskOptions

    asker = _asker(stores[store], tiny_dirs)
    hits = asker.retrieve(QUESTION, 3) if system != "closed" else []
    for scheme in ("rotate", "shared"):
        for order in ("retrieval", "best-last"):
            for recompute, blend in ((0, 0.0), (4, 0.0), (0, 0.5)):
                options = AskOptions(system, 3, scheme, order=order, recompute=recompute, blend=blend).check()
                plan = asker.plan(QUESTION, hits, options)
                lm, prompt = asker.prompt_of(plan, options)
                case = (store, system, scheme, order, recompute, blend)
                assert plan.end == prompt.end_position, case
                assert asker.least_end(plan.rows, options) <= plan.end, case
                assert [h.id for h in plan.hits] == [h.id for h in hits], case
                expected = [h.id for h in (reversed(hits) if order == "best-last" else hits)]
                assert plan.ids == expected == [r.id for r in plan.prompt_rows], case
                if plan.kind is not None:  # stored caches: the slots each passage fills, the positions it spans
                    arrays = asker.store.read(plan.ids, kind=plan.kind)
                    assert plan.lengths == [len(a) for a in arrays], case
                    kept = asker.store.positions(plan.ids)
                    assert plan.spans == [n if k is None else k[1] for n, k in zip(plan.lengths, kept)], case
                    assert prompt.past_tokens == len(plan.prefix_ids) + sum(plan.lengths), case
                    assert prompt.ids[prompt.recomputed:] == plan.question_ids, case
                    assert (store == "pruned") == (plan.spans != plan.lengths), case
                else:  # the text systems: the prompt is the planned ids, nothing else
                    pasted = [i for ids in plan.passage_ids for i in ids]
                    assert prompt.ids == plan.prefix_ids + pasted + plan.question_ids, case
                    assert plan.lengths == [len(ids) for ids in plan.passage_ids], case
                    assert prompt.end_position == len(prompt.ids), case
                    assert (lm is asker.session.sharer) == (system == "sharer-text"), case


def _counting_rows(monkeypatch) -> Counter:
    """Every id `CacheStore.get_rows` is asked for, counted."""
    from cachegraft_cli.store import CacheStore

    fetched: Counter = Counter()
    get_rows = CacheStore.get_rows

    def counted(self, ids):
        fetched.update(ids)
        return get_rows(self, ids)

    monkeypatch.setattr(CacheStore, "get_rows", counted)
    return fetched


@pytest.mark.parametrize("system, recompute", [("graft", 0), ("graft", 4), ("text", 0), ("sharer-text", 0)])
def test_an_ask_reads_each_passages_row_once(stores, tiny_dirs, monkeypatch, system, recompute):
    """`Store.ask` (its checks before loading, retrieval, assembly, the answer's sources) and
    `Store.ask_many` read each retrieved passage's row once per question."""
    import cachegraft_cli as cg

    store = cg.open_store(stores["whole"], sharer=str(tiny_dirs["sharer_other"]), device="cpu")
    settings = dict(system=system, k=3, recompute=recompute, max_new_tokens=2)
    store.warm(system)  # the index and the models: loading them reads no row
    fetched = _counting_rows(monkeypatch)
    answer = store.ask(QUESTION, **settings)
    assert fetched == Counter(s.id for s in answer.sources) and len(answer.sources) == 3, fetched
    fetched.clear()
    questions = [QUESTION, "where did the fishermen found the town?"]
    answers = store.ask_many(questions, batch_size=2, **settings)
    assert fetched == Counter(s.id for a in answers for s in a.sources), fetched
    fetched.clear()
    store.check_ask(questions, cg.ask_options(**settings))  # the CLI's order: checked first, then answered
    answers = store.ask_many(questions, batch_size=2, **settings)
    assert fetched == Counter(s.id for a in answers for s in a.sources), fetched


def test_a_checked_ask_is_not_checked_again(stores, tiny_dirs, monkeypatch):
    """`check_ask` then `ask` with the same question and options checks the question, the store's
    options and the context window once."""
    import cachegraft_cli as cg
    from cachegraft_cli.answering import systems
    from cachegraft_cli.answering.ask import Asker

    calls: Counter = Counter()
    for name, owner in (("check_options", Asker), ("check_fits", Asker), ("check_question", systems)):
        original = getattr(owner, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)
    store = cg.open_store(stores["whole"], device="cpu")
    options = cg.ask_options(k=2, max_new_tokens=2)
    store.check_ask([QUESTION], options, note=lambda line: None)
    store.ask(QUESTION, options)
    assert calls == {"check_options": 1, "check_fits": 1, "check_question": 1}, calls
    store.ask(QUESTION, options, k=1)  # other options: checked anew
    assert calls == {"check_options": 2, "check_fits": 2, "check_question": 2}, calls
