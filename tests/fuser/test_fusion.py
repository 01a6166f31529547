"""Exactness backbone: offline fused caches == online C2C; closed fuser ==
receiver alone; RoPE re-rotation == encoding at shifted positions."""

import pytest
import torch
from tiny import open_fuser

from cachegraft_cli.fuser.fusion import PassageFusion
from cachegraft_cli.fuser.online import online_logits
from cachegraft_cli.lm import kvcache
from cachegraft_cli.lm.template import PromptTemplate

PASSAGES = [
    ("Harbor", "Harbor town was founded in 1820 by fishermen who built the first lighthouse."),
    ("", "The quick brown fox."),
    ("Treaty", "The treaty was signed in Vienna after long talks between the two empires, 56.7% agreed."),
]


def _offline_logits(receiver, engine, passage_kv, prefix_len, passage_len, question):
    past = kvcache.concat_tokens([kvcache.batched(engine.prefix_kv()), kvcache.batched(passage_kv)])
    cache = kvcache.to_model_cache(past, receiver.model.config)
    start = prefix_len + passage_len
    positions = torch.arange(start, start + len(question))[None]
    with torch.no_grad():
        out = receiver.model(input_ids=torch.tensor([question]), cache=cache, position_ids=positions)
    return out.logits[0]


@pytest.mark.parametrize("sharer_role", ["sharer_same", "sharer_other"])
def test_offline_equals_online_reference(tiny_models, sharer_role):
    r, s = tiny_models["receiver"], tiny_models[sharer_role]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    prefix, question = tpl.prefix_ids(), tpl.question_ids("who built the lighthouse?")
    passages = [tpl.passage_ids(t, x) for t, x in PASSAGES]
    fuser = open_fuser(r, s)
    engine = PassageFusion(r, prefix, s, fuser)
    fused = engine.fuse(passages)  # one batched, right-padded forward
    for ids, kv in zip(passages, fused):
        offline = _offline_logits(r, engine, kv.fused, len(prefix), len(ids), question)
        online = online_logits(r, s, fuser, [(prefix, False), (ids, True), (question, False)])
        plain = online_logits(r, None, None, [(prefix, False), (ids, False), (question, False)])
        assert (offline - online).abs().max() <= 1e-4
        assert (online - plain).abs().max() > 1e-2  # the fusion really changed something


def test_closed_fuser_gives_receiver_logits_exactly(tiny_models):
    r, s = tiny_models["receiver"], tiny_models["sharer_other"]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    prefix, question = tpl.prefix_ids(), tpl.question_ids("where was the treaty signed?")
    ids = tpl.passage_ids(*PASSAGES[2])
    fuser = open_fuser(r, s)
    fuser.set_gates(0.0)  # the untrained default: logit 0 is closed
    engine = PassageFusion(r, prefix, s, fuser)
    kv = engine.fuse([ids])[0]
    for (kf, vf), (ko, vo) in zip(kv.fused, kv.own):
        assert torch.equal(kf, ko) and torch.equal(vf, vo)
    offline = _offline_logits(r, engine, kv.fused, len(prefix), len(ids), question)
    with torch.no_grad():
        full = r.model(input_ids=torch.tensor([prefix + ids + question])).logits[0, -len(question) :]
    assert (offline - full).abs().max() <= 1e-4


def test_batched_fuse_equals_one_at_a_time(tiny_models):
    r, s = tiny_models["receiver"], tiny_models["sharer_same"]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    engine = PassageFusion(r, tpl.prefix_ids(), s, open_fuser(r, s, seed=5))
    passages = [tpl.passage_ids(t, x) for t, x in PASSAGES]
    batched = engine.fuse(passages)
    for ids, b in zip(passages, batched):
        single = engine.fuse([ids])[0]
        assert kvcache.num_tokens(b.fused) == len(ids)
        for (kb, vb), (ks, vs) in zip(b.fused, single.fused):
            torch.testing.assert_close(kb, ks, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(vb, vs, atol=1e-5, rtol=1e-5)


def test_key_rerotation_matches_encoding_at_shifted_positions(tiny_models):
    """Rotating a receiver-only cache block by an offset == encoding it at the
    shifted positions. Tolerance: 1e-4 on logits in float32 (the rotation is
    computed in float64 and rounded once)."""
    r = tiny_models["receiver"]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    ids = tpl.prefix_ids() + tpl.passage_ids(*PASSAGES[0])
    question = tpl.question_ids("when was the town founded?")
    delta, n = 37, len(ids)
    with torch.no_grad():
        canonical = kvcache.from_model_cache(r.model(input_ids=torch.tensor([ids]), use_cache=True).cache)
        shifted_pos = torch.arange(delta, delta + n)[None]
        shifted = r.model(input_ids=torch.tensor([ids]), position_ids=shifted_pos, use_cache=True).cache
        rotated = kvcache.KeyRotator.for_model(r.model).rotate(canonical, delta)
        for (kr, vr), (ks, vs) in zip(rotated, kvcache.from_model_cache(shifted)):
            torch.testing.assert_close(kr, ks, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(vr, vs, atol=1e-4, rtol=1e-4)
        q_pos = torch.arange(delta + n, delta + n + len(question))[None]
        a = r.model(input_ids=torch.tensor([question]), cache=kvcache.to_model_cache(rotated, r.model.config),
                    position_ids=q_pos)
        b = r.model(input_ids=torch.tensor([question]), cache=shifted, position_ids=q_pos)
    assert (a.logits - b.logits).abs().max() <= 1e-4


def test_token_major_round_trip(tiny_models):
    r = tiny_models["receiver"]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    kv = PassageFusion(r, tpl.prefix_ids()).fuse([tpl.passage_ids(*PASSAGES[1])])[0].own
    arr = kvcache.to_token_major(kv)
    g = r.geometry
    assert arr.shape == (kvcache.num_tokens(kv), g.layers, 2, g.kv_heads, g.head_dim)
    back = kvcache.from_token_major(arr)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv, back))


def test_fuser_for_other_geometry_is_refused(tiny_models):
    from cachegraft_cli.errors import CheckpointError

    r, s = tiny_models["receiver"], tiny_models["sharer_same"]
    wrong = open_fuser(r, tiny_models["sharer_other"])
    with pytest.raises(CheckpointError, match="KV heads"):
        PassageFusion(r, [1, 2], s, wrong)
