"""The lean decode step (`lm/decoder.py`) against transformers' forward: the same logits and the
same cache, one row or a padded batch, exact or quantised weights, Qwen2 and Qwen3 shapes."""

import pytest
import torch

from cachegraft_cli.lm import decoder, weights
from cachegraft_cli.lm.generation import Prompt, Stepper, prefill_batch
from cachegraft_cli.lm.models import load_causal_lm

TOL = dict(rtol=1e-4, atol=1e-4)  # float32 logits of order 10: summation order only, if anything


def hf_step(lm, cache, ids, positions, mask):
    kwargs = {} if mask is None else {"attention_mask": mask}
    out = lm.model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs)
    return out.logits[:, -1].float()


def load(tiny_dirs, role, scheme):
    if scheme != "as-loaded" and not weights.available(scheme):
        pytest.skip(f"this torch build lacks the {scheme} CPU kernel")
    return load_causal_lm(str(tiny_dirs[role]), device="cpu", dtype="float32", weights=scheme)


@pytest.mark.parametrize("role", ["receiver", "sharer_same"])  # Qwen2 (q/k/v biases), Qwen3 (q/k norms)
@pytest.mark.parametrize("scheme", ["as-loaded", "int8", "int4"])
def test_a_padded_batch_steps_as_transformers_steps_it(tiny_dirs, role, scheme):
    lm = load(tiny_dirs, role, scheme)
    lean = decoder.for_model(lm.model)
    assert lean is not None
    if scheme != "as-loaded" and role == "receiver":  # int4 stacks whole 64-row blocks: gate/up's 128 rows
        assert lean.layers[0].gate_up.stacked is not None
    prompts = [Prompt.plain(None, list(range(5, 5 + n)), 0) for n in (12, 20, 7)]
    (ref, ref_logits, positions), (got, _, _) = prefill_batch(lm, prompts), prefill_batch(lm, prompts)
    tokens, positions = ref_logits.argmax(-1)[:, None], positions[:, None]
    with torch.inference_mode():
        for _ in range(5):
            ones = torch.ones(len(prompts), 1, dtype=torch.long)
            ref.mask, got.mask = torch.cat([ref.mask, ones], 1), torch.cat([got.mask, ones], 1)
            want = hf_step(lm, ref.cache, tokens, positions, ref.mask)
            have = lean.step(got.cache, tokens, positions, got.mask).float()
            torch.testing.assert_close(have, want, **TOL)
            assert torch.equal(have.argmax(-1), want.argmax(-1))
            tokens, positions = want.argmax(-1)[:, None], positions + 1
    for a, b in zip(ref.cache.layers, got.cache.layers):
        torch.testing.assert_close(b.keys, a.keys, **TOL)
        torch.testing.assert_close(b.values, a.values, **TOL)


@pytest.mark.parametrize("scheme", ["as-loaded", "int8"])
def test_one_row_without_a_mask_generates_what_transformers_generates(tiny_dirs, scheme, monkeypatch):
    from cachegraft_cli.lm.generation import GenerationOptions, generate

    lm = load(tiny_dirs, "receiver", scheme)
    prompt = Prompt.plain(None, list(range(3, 40)), 0)
    lean = generate(lm, prompt, GenerationOptions(max_new_tokens=12))
    monkeypatch.setattr(decoder, "for_model", lambda model: None)  # transformers' forward for every step
    plain = generate(lm, prompt, GenerationOptions(max_new_tokens=12))
    assert lean.token_ids == plain.token_ids and len(lean.token_ids) > 1


@pytest.mark.parametrize("role", ["receiver", "sharer_same"])
@pytest.mark.parametrize("scheme", ["as-loaded", "int4"])
@pytest.mark.parametrize("hidden", [False, True])
def test_several_tokens_a_row_step_as_transformers_reads_them(tiny_dirs, role, scheme, hidden):
    """`Decoder.run` (a last token and its drafts in one step): each token sees the cache and the
    new tokens before it, and no hidden slot."""
    lm = load(tiny_dirs, role, scheme)
    lean = decoder.for_model(lm.model)
    steppers = [Stepper(lm, Prompt.plain(None, list(range(5, 25)), 0)) for _ in range(2)]
    mask = torch.ones(1, 25, dtype=torch.long)
    mask[0, 3:8] = 0 if hidden else 1
    ids, positions = torch.tensor([[7, 9, 11, 13, 2]]), torch.arange(20, 25)[None]
    with torch.inference_mode():
        for s in steppers:
            s.first()
        out = lm.model(input_ids=ids, cache=steppers[0].cache, position_ids=positions, use_cache=True,
                       logits_to_keep=5, attention_mask=mask)
        have = lean.run(steppers[1].cache, ids, positions, mask if hidden else None).float()
    torch.testing.assert_close(have, out.logits.float(), **TOL)
    for a, b in zip(steppers[0].cache.layers, steppers[1].cache.layers):
        torch.testing.assert_close(b.keys, a.keys, **TOL)


def test_one_step_with_hidden_slots_matches(tiny_dirs):
    """`generate`'s 2D mask (stored tokens recomputed in context stay hidden) reaches the lean step."""
    lm = load(tiny_dirs, "receiver", "as-loaded")
    steppers = [Stepper(lm, Prompt.plain(None, list(range(5, 25)), 0)) for _ in range(2)]
    with torch.inference_mode():
        for s in steppers:
            s.first()
            s.mask = torch.ones(1, 20, dtype=torch.long)
            s.mask[0, 3:8] = 0
        mask = torch.cat([steppers[0].mask, torch.ones(1, 1, dtype=torch.long)], 1)
        ids, positions = torch.tensor([[7]]), torch.tensor([[20]])
        want = hf_step(lm, steppers[0].cache, ids, positions, mask)
        have = steppers[1](ids[0].tolist())
    torch.testing.assert_close(have[None], want, **TOL)


def test_fused_int8_projections_hold_no_second_copy(tiny_dirs):
    lm = load(tiny_dirs, "receiver", "int8")
    lean = decoder.for_model(lm.model)
    layer = lean.layers[0]
    assert layer.qkv.stacked is not None and layer.gate_up.stacked is not None
    q_proj = lm.model.model.layers[0].self_attn.q_proj
    assert q_proj.qweight.untyped_storage().data_ptr() == layer.qkv.stacked.qweight.untyped_storage().data_ptr()
    # a prompt longer than the kernels' rows still reads each layer's own (dense) weights
    assert q_proj(torch.zeros(1, 20, q_proj.in_features)).shape == (1, 20, q_proj.out_features)


def test_models_it_does_not_run_keep_transformers_forward(tiny_dirs):
    other = load_causal_lm(str(tiny_dirs["sharer_other"]), device="cpu", dtype="float32")  # Llama
    assert decoder.for_model(other.model) is None
    lm = load(tiny_dirs, "receiver", "as-loaded")
    lm.model.set_attn_implementation("sdpa")  # not the packed one-token GQA the lean step reproduces
    assert not decoder.supported(lm.model)


def test_replaced_layers_get_a_new_decoder(tiny_dirs):
    lm = load(tiny_dirs, "receiver", "as-loaded")
    before = decoder.for_model(lm.model)
    assert decoder.for_model(lm.model) is before
    weights.quantize_linears(lm.model, "int8")
    after = decoder.for_model(lm.model)
    assert after is not before and after.layers[0].qkv.stacked is not None
