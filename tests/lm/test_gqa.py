"""GQA attention packed per KV head (`lm/gqa.py`): the same attention as transformers'
SDPA path, on random tensors and through a tiny model's decode."""

import pytest
import torch

from cachegraft_cli.lm import gqa


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _reference(query, key, value, mask, scale):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (14, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("mask_kind", [None, "additive", "bool", "per-head"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_matches_repeated_kv_attention(heads, kv_heads, mask_kind, q_len):
    torch.manual_seed(heads + q_len)
    batch, kv, dim = 2, 37, 16
    q = torch.randn(batch, heads, q_len, dim)
    k, v = torch.randn(batch, kv_heads, kv, dim), torch.randn(batch, kv_heads, kv, dim)
    seen = torch.rand(batch, 1, q_len, kv) > 0.3
    seen[..., -1] = True  # every query sees at least one key
    if mask_kind == "per-head":
        seen = seen.expand(batch, heads, q_len, kv).clone()
        seen[:, 0, :, 0] = ~seen[:, 0, :, 0]
    mask = None if mask_kind is None else seen if mask_kind == "bool" else \
        torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    layer = _Layer(heads // kv_heads)
    got, weights = gqa.cpu_sdpa(layer, q, k, v, mask, scaling=0.25)
    assert weights is None and got.shape == (batch, q_len, heads, dim) and got.is_contiguous()
    if q_len == 1 or mask is not None:  # packed: several queries each keep their own mask row
        torch.testing.assert_close(got, _reference(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)
    else:  # several queries without a mask (causal by flag): transformers' own SDPA path, untouched
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        assert torch.equal(got, sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25)[0])


def test_decode_through_a_model_matches_sdpa(tiny_models):
    from cachegraft_cli.lm.generation import Prompt, Stepper

    lm = tiny_models["receiver"]
    assert lm.model.config._attn_implementation == gqa.NAME  # installed at load
    ids = list(range(5, 40))

    def decode() -> list[torch.Tensor]:
        with torch.inference_mode():
            step = Stepper(lm, Prompt.plain(None, ids, 0))
            out = [step.first()]
            out += [step([7 + i]) for i in range(6)]
        return out

    packed = decode()
    lm.model.set_attn_implementation("sdpa")
    try:
        plain = decode()
    finally:
        assert gqa.install(lm.model)
    for a, b in zip(packed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_install_leaves_other_implementations_alone():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="eager")
    model = Qwen2ForCausalLM(config)
    assert not gqa.install(model) and model.config._attn_implementation == "eager"
