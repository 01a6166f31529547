"""Exactness of passage assembly (assembly.py): recompute N = 0 is the plain
stored-cache path bit for bit; recomputing every passage token of the
receiver's own caches is the `text` computation; the one batched recompute
forward equals recomputing one passage at a time; hidden slots stay hidden
while decoding; batched decoding equals one prompt at a time."""

import pytest
import torch
from tiny import open_fuser

from cachegraft_cli.answering.assembly import Assembler, AssemblyOptions, Layout, in_prompt_order, visibility
from cachegraft_cli.fuser.fusion import PassageFusion
from cachegraft_cli.lm import kvcache
from cachegraft_cli.lm.generation import GenerationOptions, Prompt, generate, generate_batch, prompt_logits
from cachegraft_cli.lm.template import PromptTemplate

PASSAGES = [
    ("Harbor", "Harbor town was founded in 1820 by fishermen who built the first lighthouse."),
    ("", "The quick brown fox jumps over the lazy dog near the river bank."),
    ("Treaty", "The treaty was signed in Vienna after long talks between the two empires, 56.7% agreed."),
    ("Light", "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen."),
]
QUESTION = "who built the first lighthouse?"


def _setup(tiny_models, fused: bool, sharer_role: str = "sharer_same"):
    r, s = tiny_models["receiver"], tiny_models[sharer_role]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    fuser = None
    if fused:
        fuser = open_fuser(r, s, seed=3)
    engine = PassageFusion(r, tpl.prefix_ids(), s if fused else None, fuser)
    ids = [tpl.passage_ids(t, x) for t, x in PASSAGES]
    kvs = engine.fuse(ids)
    arrays = [kvcache.to_token_major(kv.fused) for kv in kvs]
    return r, tpl, Assembler(r, engine.prefix_kv()), arrays, ids


def _text_logits(r, tpl, ids):
    question = tpl.question_ids(QUESTION)
    tokens = tpl.prefix_ids() + [t for p in ids for t in p] + question
    with torch.no_grad():
        return r.model(input_ids=torch.tensor([tokens])).logits[0, -len(question):].float()


def test_recompute_zero_is_the_plain_path_bit_for_bit(tiny_models):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=True)
    question = tpl.question_ids(QUESTION)
    prompt = asm.prompt(arrays, ids, question, AssemblyOptions(recompute=0))
    assert prompt.visible is None and prompt.hidden == [] and prompt.ids == question
    # today's path, written out: prefix + passages re-rotated one after another, question after them
    rot, prefix = kvcache.KeyRotator.for_model(r.model), kvcache.from_token_major(
        kvcache.to_token_major(asm.prefix), r.dtype)
    parts, position = [prefix], len(tpl.prefix_ids())
    for a in arrays:
        parts.append(rot.rotate(kvcache.from_token_major(a, r.dtype), position - len(tpl.prefix_ids())))
        position += len(a)
    reference = Prompt.plain(kvcache.batched(kvcache.concat_tokens(parts)), question, position)
    assert torch.equal(prompt_logits(r, prompt), prompt_logits(r, reference))
    assert generate(r, prompt, GenerationOptions(6)).token_ids == generate(r, reference, GenerationOptions(6)).token_ids


@pytest.mark.parametrize("options", [AssemblyOptions(recompute=10_000), AssemblyOptions(recompute=0, blend=1.0)],
                         ids=["boundary-all", "blend-all"])
def test_recomputing_every_own_token_gives_text_logits(tiny_models, options):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=False)
    prompt = asm.prompt(arrays, ids, tpl.question_ids(QUESTION), options)
    assert prompt.recomputed == sum(len(p) for p in ids[1:])  # every passage after the first
    text = _text_logits(r, tpl, ids)
    plain = prompt_logits(r, asm.prompt(arrays, ids, tpl.question_ids(QUESTION), AssemblyOptions(recompute=0)))
    assert (prompt_logits(r, prompt) - text).abs().max() <= 1e-4
    assert (plain - text).abs().max() > 1e-3  # independent encoding really differs from text here


def _one_passage_at_a_time(r, asm, arrays, ids, question, n):
    """Reference: recompute passage j's first n tokens against the cache as fixed so far
    (prefix, earlier passages with their recomputed tokens), one forward per passage."""
    past, layout = asm.past(arrays, "rotate")
    past = [(k.clone(), v.clone()) for k, v in past]
    for j in range(1, len(arrays)):
        start, count = layout.starts[j], min(n, layout.lengths[j])
        context = kvcache.to_model_cache(kvcache.slice_tokens(past, 0, start), r.model.config)
        with torch.no_grad():
            out = r.model(input_ids=torch.tensor([ids[j][:count]]), cache=context,
                          position_ids=torch.arange(start, start + count)[None], use_cache=True)
        new = kvcache.slice_tokens(kvcache.from_model_cache(out.cache), start, start + count)
        for (k, v), (nk, nv) in zip(past, new):
            k[..., start:start + count, :] = nk
            v[..., start:start + count, :] = nv
    return Prompt.plain(past, question, layout.question_start)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "own"])
def test_batched_recompute_equals_one_passage_at_a_time(tiny_models, fused):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=fused)
    question = tpl.question_ids(QUESTION)
    n = 5
    batched = asm.prompt(arrays, ids, question, AssemblyOptions(recompute=n))
    assert batched.recomputed == n * (len(ids) - 1)
    reference = _one_passage_at_a_time(r, asm, arrays, ids, question, n)
    assert (prompt_logits(r, batched) - prompt_logits(r, reference)).abs().max() <= 1e-4
    # decoding keeps the replaced stored copies hidden: same tokens as the rebuilt cache
    config = GenerationOptions(8)
    assert generate(r, batched, config).token_ids == generate(r, reference, config).token_ids


def test_recompute_changes_fused_answers_logits(tiny_models):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=True)
    question = tpl.question_ids(QUESTION)
    a = prompt_logits(r, asm.prompt(arrays, ids, question, AssemblyOptions(recompute=0)))
    b = prompt_logits(r, asm.prompt(arrays, ids, question, AssemblyOptions(recompute=4)))
    assert (a - b).abs().max() > 1e-3


def test_shared_scheme_recompute_uses_canonical_positions(tiny_models):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=False)
    prompt = asm.prompt(arrays, ids, tpl.question_ids(QUESTION), AssemblyOptions(scheme="shared", recompute=3))
    base = len(tpl.prefix_ids())
    assert prompt.positions[:3] == [base, base + 1, base + 2]  # passage 1 restarts at the canonical positions
    assert prompt.positions[prompt.recomputed] == base + max(len(p) for p in ids)
    assert torch.isfinite(prompt_logits(r, prompt)).all()


def test_batched_decode_with_recompute_equals_single(tiny_models):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=True)
    questions = ["who built the first lighthouse?", "where was the treaty signed?", "what does light make?"]
    prompts = [
        asm.prompt(arrays, ids, tpl.question_ids(questions[0]), AssemblyOptions(recompute=4)),
        asm.prompt(arrays[:2], ids[:2], tpl.question_ids(questions[1]), AssemblyOptions(recompute=0)),
        asm.prompt(arrays[1:], ids[1:], tpl.question_ids(questions[2]), AssemblyOptions(recompute=7)),
        Prompt.plain(None, tpl.prefix_ids() + tpl.question_ids(questions[0]), 0),
    ]
    config = GenerationOptions(6)
    singles = [generate(r, p, config).token_ids for p in prompts]
    assert [g.token_ids for g in generate_batch(r, prompts, config)] == singles


def test_blend_picks_the_most_deviating_tokens(tiny_models):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=False)
    past, layout = asm.past(arrays, "rotate")
    options = AssemblyOptions(recompute=2, blend=0.25)
    chosen = set(layout.boundary_slots(2))
    picked = asm.blend_slots(past, layout, ids, options, chosen)
    later = layout.later_slots()
    assert len(picked) == -(-len(later) // 4) and not set(picked) & chosen and set(picked) <= set(later)
    prompt = asm.prompt(arrays, ids, tpl.question_ids(QUESTION), options)
    assert sorted(prompt.hidden) == sorted(chosen | set(picked))


def test_visibility_matrix():
    vis = visibility(6, hidden=[3, 4], orders=[3, 4, 6, 7])
    assert vis.shape == (4, 10)
    assert vis[0, :6].tolist() == [True, True, True, False, False, False]  # slot 3 sees 0..2, not its stale copy
    assert vis[1, :6].tolist() == [True, True, True, False, False, False]
    assert vis[2, :6].tolist() == [True, True, True, False, False, True]  # the question sees all but stale slots
    assert vis[:, 6:].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    with pytest.raises(ValueError):
        visibility(6, [3], [4, 3])


def test_layout_and_order():
    layout = Layout.of(5, [4, 3, 6], "rotate")
    assert layout.starts == (5, 9, 12) and layout.question_start == 18
    assert layout.boundary_slots(2) == [9, 10, 12, 13]
    shared = Layout.of(5, [4, 3, 6], "shared")
    assert shared.position(10) == 6 and shared.question_start == 11 and shared.offset(2) == 0
    assert in_prompt_order([1, 2, 3], "best-last") == [3, 2, 1]
    assert in_prompt_order([1, 2, 3], "retrieval") == [1, 2, 3]


@pytest.mark.parametrize("bad", [dict(order="random"), dict(recompute=-1), dict(blend=1.5), dict(scheme="x")])
def test_bad_assembly_options_are_refused(bad):
    from cachegraft_cli.errors import UsageError

    with pytest.raises(UsageError):
        AssemblyOptions(**bad).check()
