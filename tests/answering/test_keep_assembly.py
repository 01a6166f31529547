"""Passages of a pruned store (`encode --keep`) keep their original positions when
assembled: the pruned past is the full past's kept slots bit for bit, it answers as the
full past with the dropped tokens hidden, and recompute re-reads the stored tokens at
their own positions; `ask` answers from pruned and unpruned stores alike."""

import numpy as np
import pytest
import torch

from cachegraft_cli.answering.assembly import Assembler, AssemblyOptions, Layout, visibility
from cachegraft_cli.fuser.fuser import Fuser
from cachegraft_cli.fuser.fusion import PassageFusion
from cachegraft_cli.lm import kvcache
from cachegraft_cli.lm.generation import GenerationOptions, Prompt, generate, prompt_logits
from cachegraft_cli.lm.template import PromptTemplate
from cachegraft_cli.store.target import Target

PASSAGES = [
    ("Harbor", "Harbor town was founded in 1820 by fishermen who built the first lighthouse."),
    ("", "The quick brown fox jumps over the lazy dog near the river bank."),
    ("Treaty", "The treaty was signed in Vienna after long talks between the two empires, 56.7% agreed."),
    ("Light", "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen."),
]
QUESTION = "who built the first lighthouse?"


def _setup(tiny_models, fused: bool = True):
    """(receiver, template, assembler, fused token-major caches, passage ids) through a random open fuser."""
    r, s = tiny_models["receiver"], tiny_models["sharer_same"]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    torch.manual_seed(3)
    fuser = Fuser.create(r.spec, s.spec, r.geometry, s.geometry, hidden_dim=32, intermediate_dim=32)
    fuser.set_gates(1.0)
    fuser.eval()
    engine = PassageFusion(r, tpl.prefix_ids(), s, fuser)
    ids = [tpl.passage_ids(t, x) for t, x in PASSAGES]
    arrays = [kvcache.to_token_major(kv.fused) for kv in engine.fuse(ids)]
    return r, tpl, Assembler(r, engine.prefix_kv()), arrays, ids


def _every_other(arrays):
    """Kept positions: the first, the last and every other token."""
    return [sorted({0, len(a) - 1} | set(range(1, len(a) - 1, 2))) for a in arrays]


def test_pruned_layout_positions():
    kept = [(np.array([0, 2, 3]), 5), None, (np.array([0, 4]), 6)]
    layout = Layout.of(4, [3, 2, 2], "rotate", kept)
    assert layout.starts == (4, 7, 9) and layout.past_tokens == 11
    assert [layout.position(s) for s in range(11)] == [0, 1, 2, 3, 4, 6, 7, 9, 10, 11, 15]
    assert layout.offset(1) == 5 and layout.offset(2) == 7 and layout.question_start == 4 + 5 + 2 + 6
    shared = Layout.of(4, [3, 2, 2], "shared", kept)
    assert [shared.position(s) for s in range(4, 11)] == [4, 6, 7, 4, 5, 4, 8] and shared.question_start == 10
    assert Layout.of(4, [3, 2], "rotate", [None, None]) == Layout.of(4, [3, 2], "rotate")


@pytest.mark.parametrize("scheme", ["rotate", "shared"])
def test_pruned_past_is_the_full_past_without_the_dropped_tokens(tiny_models, scheme):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=True)
    question = tpl.question_ids(QUESTION)
    kept = _every_other(arrays)
    pruned = [a[k] for a, k in zip(arrays, kept)]
    info = [(np.array(k), len(a)) for k, a in zip(kept, arrays)]
    prompt = asm.prompt(pruned, ids, question, AssemblyOptions(scheme=scheme), info)

    full, layout = asm.past(arrays, scheme)
    slots = list(range(layout.prefix_tokens)) + [layout.starts[i] + j for i, k in enumerate(kept) for j in k]
    for (k1, v1), (k2, v2) in zip(prompt.past, full):  # same keys (rotated by the full passages' offsets), same values
        assert torch.equal(k1, k2[..., slots, :]) and torch.equal(v1, v2[..., slots, :])
    dropped = sorted(set(range(layout.past_tokens)) - set(slots))
    q0 = layout.question_start
    reference = Prompt(full, question, list(range(q0, q0 + len(question))),
                       visibility(layout.past_tokens, dropped, range(layout.past_tokens,
                                                                     layout.past_tokens + len(question))), dropped)
    assert prompt.positions == reference.positions
    # one attention over fewer slots vs the same attention with the others masked: equal up to summation order
    torch.testing.assert_close(prompt_logits(r, prompt), prompt_logits(r, reference), atol=1e-4, rtol=1e-4)
    assert generate(r, prompt, GenerationOptions(4)).token_ids == generate(r, reference, GenerationOptions(4)).token_ids


def test_recompute_rereads_pruned_tokens_at_their_own_positions(tiny_models):
    r, tpl, asm, arrays, ids = _setup(tiny_models, fused=True)
    kept = _every_other(arrays)
    pruned = [a[k] for a, k in zip(arrays, kept)]
    info = [(np.array(k), len(a)) for k, a in zip(kept, arrays)]
    prompt = asm.prompt(pruned, ids, tpl.question_ids(QUESTION), AssemblyOptions(recompute=3), info)
    prefix = len(tpl.prefix_ids())
    starts = [prefix + sum(len(a) for a in arrays[:i]) for i in range(len(arrays))]
    want_ids = [ids[i][j] for i in range(1, len(ids)) for j in kept[i][:3]]
    want_positions = [starts[i] + j for i in range(1, len(ids)) for j in kept[i][:3]]
    assert prompt.recomputed == len(want_ids) == 9
    assert prompt.ids[:9] == want_ids and prompt.positions[:9] == want_positions
    assert prompt.positions[9] == prefix + sum(len(a) for a in arrays)  # the question after the whole passages


def test_ask_reads_pruned_and_unpruned_stores(tiny_dirs, tmp_path):
    from cachegraft_cli.answering.ask import Asker, AskOptions
    from cachegraft_cli.corpus import Passage
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.session import ModelChoice, ModelSession

    session = ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32"))
    passages = [Passage(f"p{i}", "", f"The lighthouse number {i} was built by the fishermen of town {i}.")
                for i in range(4)]
    answers = {}
    for keep in (1.0, 0.5):
        url = str(tmp_path / f"keep{keep}")
        encode_corpus(passages, Target.open(url), session, EncodeOptions(codec="bf16", keep=keep))
        build_store_index(url)
        asker = Asker(url, session=session)
        for recompute in (0, 4):
            before = asker.store.stats_bytes_read
            result = asker.ask("who built the lighthouse", AskOptions("graft", 3, recompute=recompute,
                                                                      generation=GenerationOptions(4)))
            answers[keep, recompute] = asker.store.stats_bytes_read - before
            assert len(result["passages"]) == 3 and result["answer"] is not None
    assert answers[0.5, 0] < answers[1.0, 0]  # fewer tokens read (whole 16-token chunks, so not half)
