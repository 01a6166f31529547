"""Copied drafts (lm/drafting.py, `Row.take_checked`): the drafter's lookups; a greedy answer
decoded with drafts is the answer decoded one token per step (up to rounding, checked by
greedy margins), in fewer forwards when the drafts are right; a close call goes to a
one-token step; `RunningBatch` drafts a lone row as `generate` does."""

import pytest
import torch
from conftest import MIN_GREEDY_MARGIN

from cachegraft_cli.answering.assembly import Assembler, AssemblyOptions
from cachegraft_cli.errors import UsageError
from cachegraft_cli.fuser.fusion import PassageFusion
from cachegraft_cli.lm import generation, kvcache
from cachegraft_cli.lm.batching import RunningBatch
from cachegraft_cli.lm.drafting import MAX_DRAFT_TOKENS, CopyDrafter
from cachegraft_cli.lm.generation import GenerationOptions, Prompt, Row, generate
from cachegraft_cli.lm.template import PromptTemplate

PASSAGES = [
    ("Harbor", "Harbor town was founded in 1820 by fishermen who built the first lighthouse."),
    ("Treaty", "The treaty was signed in Vienna after long talks between the two empires."),
]


def test_the_longest_match_gives_what_followed_its_last_occurrence():
    source = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 6]
    d = CopyDrafter(source, longest=3)
    assert d.draft([2, 3], room=5) == [7, 8, 2]  # (2, 3) last seen before 7; 3 tokens at most
    assert d.draft([1, 2], room=5) == [3, 4, 5]  # two tokens matched at the only place they occur
    assert d.draft([0, 9], room=2) == [2, 3]  # no pair: the last token alone
    assert d.draft([6], room=5) == []  # at the very end: nothing follows it
    assert d.draft([42], room=5) == [] and d.draft([], room=5) == []
    assert d.draft([2, 3], room=0) == []


def test_a_callable_source_is_read_once_and_only_when_a_draft_is_asked():
    calls = []

    def source():
        calls.append(1)
        return [5, 6, 7]

    d = CopyDrafter(source)
    assert calls == []
    assert d.draft([5], room=4) == [6, 7] and d.draft([6], room=4) == [7]
    assert calls == [1]


def test_draft_tokens_is_checked():
    assert GenerationOptions(draft_tokens=0).check().draft_tokens == 0
    for bad in (-1, MAX_DRAFT_TOKENS + 1, 2.0, True):
        with pytest.raises(UsageError, match="draft_tokens"):
            GenerationOptions(draft_tokens=bad).check()


@pytest.fixture(scope="module")
def prompts(tiny_models):
    """A stored-cache prompt, one with recomputed (hidden) slots, and a text prompt."""
    r = tiny_models["receiver"]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    fusion = PassageFusion(r, tpl.prefix_ids(), None, None)
    ids = [tpl.passage_ids(t, x) for t, x in PASSAGES]
    arrays = [kvcache.to_token_major(kv.fused) for kv in fusion.fuse(ids)]
    asm = Assembler(r, fusion.prefix_kv())
    question = tpl.question_ids("who built the first lighthouse?")
    return r, [
        asm.prompt(arrays, ids, question, AssemblyOptions(recompute=0)),
        asm.prompt(arrays, ids, question, AssemblyOptions(recompute=4)),
        Prompt.plain(None, tpl.prefix_ids() + [i for p in ids for i in p] + question, 0),
    ]


class _Forwards:
    """Forwards after the first token and the tokens they fed (at `generation.row_step`, which
    `batching` reaches through `generation.decode_row`)."""

    def __init__(self, monkeypatch):
        self.fed: list[int] = []
        real = generation.row_step

        def counted(lm, cache, ids, positions, mask):
            self.fed.append(len(ids))
            return real(lm, cache, ids, positions, mask)

        monkeypatch.setattr(generation, "row_step", counted)


def _with_source(prompt: Prompt, source) -> Prompt:
    return Prompt(prompt.past, prompt.ids, prompt.positions, prompt.visible, prompt.hidden, prompt.recomputed,
                  source)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_right_drafts_give_the_same_answer_in_fewer_forwards(prompts, which, monkeypatch, greedy_margins):
    r, ps = prompts
    plain = generate(r, ps[which], GenerationOptions(12, draft_tokens=0)).token_ids
    assert len(plain) >= 4  # the tiny receiver runs to its limit: something to draft
    forwards = _Forwards(monkeypatch)
    # a source holding the answer itself: each draft is what greedy decoding picks next
    drafted = generate(r, _with_source(ps[which], [*ps[which].ids, *plain]), GenerationOptions(12)).token_ids
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN
    assert drafted == plain
    assert max(forwards.fed) > 1 and len(forwards.fed) < len(plain) - 1  # several tokens a forward


def test_wrong_drafts_cost_forwards_not_the_answer(prompts, monkeypatch, greedy_margins):
    r, ps = prompts
    plain = generate(r, ps[0], GenerationOptions(10, draft_tokens=0)).token_ids
    wrong = [(t + 1) % r.model.config.vocab_size for t in plain]  # every token drafts a wrong successor
    source = [x for pair in zip(plain, wrong[1:]) for x in pair]
    forwards = _Forwards(monkeypatch)
    drafted = generate(r, _with_source(ps[0], source), GenerationOptions(10)).token_ids
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN
    assert drafted == plain and max(forwards.fed) > 1


def test_sampling_never_drafts(prompts, monkeypatch):
    r, ps = prompts
    forwards = _Forwards(monkeypatch)
    generate(r, _with_source(ps[0], list(range(50)) * 3), GenerationOptions(8, temperature=0.8, seed=3))
    assert set(forwards.fed) == {1}


def test_a_close_call_is_left_to_a_one_token_step(tiny_models):
    r = tiny_models["receiver"]
    row = Row(Prompt.plain(None, [1, 2, 3], 0), GenerationOptions(10))
    row.begin(r, 0.0, 0.0)
    row.out = [5]
    vocab = r.model.config.vocab_size
    logits = torch.zeros(4, vocab)
    logits[0, 7] = 5.0  # a clear choice: the first draft (7)
    logits[1, 8], logits[1, 9] = 5.0, 5.0 - 1e-4  # a near tie after it: not decided here
    unused = row.take_checked(logits, [7, 8, 9])
    assert row.out == [5, 7] and unused == 3  # the 7 fed as a draft is forgotten too, fed again alone
    assert row.drafts() == [] and row.alone_next is False  # the next step is a one-token one


def test_a_lone_row_in_a_running_batch_drafts_as_generate_does(prompts, monkeypatch):
    r, ps = prompts
    plain = generate(r, ps[1], GenerationOptions(12, draft_tokens=0)).token_ids
    prompt = _with_source(ps[1], [*ps[1].ids, *plain])
    forwards = _Forwards(monkeypatch)
    alone = generate(r, prompt, GenerationOptions(12)).token_ids
    by_generate = list(forwards.fed)
    forwards.fed.clear()
    row = Row(prompt, GenerationOptions(12))
    batch = RunningBatch(r)
    batch.admit([row])
    while len(batch):
        batch.step()
    assert row.out == alone and forwards.fed == by_generate and max(by_generate) > 1
