"""Continuous batching (lm/batching.py): a lone row decodes exactly as `generate`; rows that
join a running batch at different steps, with hidden slots, other pasts or none, other token
limits, each get the answer they get alone (up to rounding, checked by greedy margins); a row
that ends or is cancelled leaves without disturbing the others."""

import pytest
import torch
from conftest import MIN_GREEDY_MARGIN

from cachegraft_cli.answering.assembly import Assembler, AssemblyOptions
from cachegraft_cli.fuser.fusion import PassageFusion
from cachegraft_cli.lm import kvcache
from cachegraft_cli.lm.batching import Row, RunningBatch
from cachegraft_cli.lm.generation import GenerationOptions, Prompt, generate
from cachegraft_cli.lm.template import PromptTemplate

PASSAGES = [
    ("Harbor", "Harbor town was founded in 1820 by fishermen who built the first lighthouse."),
    ("Treaty", "The treaty was signed in Vienna after long talks between the two empires."),
    ("Light", "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen."),
]
QUESTIONS = ["who built the first lighthouse?", "where was the treaty signed?", "what does light make?"]


@pytest.fixture(scope="module")
def prompts(tiny_models):
    """Four prompts of other shapes: a plain stored-cache one, one with recomputed (hidden)
    slots, a shorter past, and text with no past at all."""
    r = tiny_models["receiver"]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    fusion = PassageFusion(r, tpl.prefix_ids(), None, None)
    ids = [tpl.passage_ids(t, x) for t, x in PASSAGES]
    arrays = [kvcache.to_token_major(kv.fused) for kv in fusion.fuse(ids)]
    asm = Assembler(r, fusion.prefix_kv())
    return r, [
        asm.prompt(arrays, ids, tpl.question_ids(QUESTIONS[0]), AssemblyOptions(recompute=0)),
        asm.prompt(arrays, ids, tpl.question_ids(QUESTIONS[1]), AssemblyOptions(recompute=4)),
        asm.prompt(arrays[:1], ids[:1], tpl.question_ids(QUESTIONS[2]), AssemblyOptions(recompute=0)),
        Prompt.plain(None, tpl.prefix_ids() + tpl.question_ids(QUESTIONS[0]), 0),
    ]


def _run(batch: RunningBatch, arrivals: dict[int, list[Row]]) -> list[Row]:
    """Admit `arrivals[step]` before decode step `step`; decode until every row has ended."""
    ended, step = [], 0
    while step <= max(arrivals) or len(batch):
        if step in arrivals:
            ended += batch.admit(arrivals[step])
        ended += batch.step()
        step += 1
    return ended


def test_a_lone_row_is_generate_bit_for_bit(prompts):
    r, ps = prompts
    for prompt in ps[:2]:
        config = GenerationOptions(10)
        heard: list[str] = []
        row = Row(prompt, config, heard.append)
        ended = _run(RunningBatch(r), {0: [row]})
        alone = generate(r, prompt, config)
        assert ended == [row] and row.out == alone.token_ids
        assert row.generation(r.tokenizer).text == alone.text == "".join(heard).strip()


def test_rows_joining_at_other_steps_get_their_own_answers(prompts, greedy_margins):
    r, ps = prompts
    limits = [12, 9, 5, 12]
    rows = [Row(p, GenerationOptions(n)) for p, n in zip(ps, limits)]
    batch = RunningBatch(r)
    ended = _run(batch, {0: [rows[0]], 2: [rows[1], rows[2]], 3: [rows[3]]})
    alone = [generate(r, p, GenerationOptions(n)).token_ids for p, n in zip(ps, limits)]
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # together vs alone: equal up to rounding only
    assert [row.out for row in rows] == alone
    assert sorted(map(id, ended)) == sorted(map(id, rows)) and len(batch) == 0 and batch.block is None


def test_a_cancelled_row_leaves_and_the_others_go_on(prompts, greedy_margins):
    r, ps = prompts
    stop = {"now": False}
    leaving = Row(ps[1], GenerationOptions(12), cancelled=lambda: stop["now"])
    staying = Row(ps[0], GenerationOptions(12))
    batch = RunningBatch(r)
    batch.admit([leaving, staying])
    batch.step()
    stop["now"] = True
    assert batch.step() == [leaving] and len(leaving.out) == 3 and batch.rows == [staying]
    while len(batch):
        batch.step()
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN
    assert staying.out == generate(r, ps[0], GenerationOptions(12)).token_ids


def test_leaving_rows_cut_the_columns_only_pads_held(prompts):
    r, ps = prompts
    long, short = Row(ps[0], GenerationOptions(2)), Row(ps[2], GenerationOptions(8))
    batch = RunningBatch(r)
    batch.admit([short])
    batch.admit([long])  # the short past is left-padded to the long one's width
    width = batch.block.mask.shape[1]
    while long in batch.rows:
        batch.step()
    assert batch.rows == [short]
    kept = kvcache.num_tokens(kvcache.from_model_cache(batch.block.cache))
    assert kept == batch.block.mask.shape[1] < width and bool(batch.block.mask[0, 0])


def test_a_zero_token_limit_ends_at_admission(prompts):
    r, ps = prompts
    row = Row(ps[0], GenerationOptions(0))
    assert RunningBatch(r).admit([row]) == [row] and row.out == []
    assert torch.isfinite(torch.tensor(row.timings["prefill"]))
