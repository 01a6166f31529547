"""The error forms the transform codec weights by: values through o_proj, keys by the queries."""

import numpy as np
import pytest
import torch

from cachegraft_cli.lm.errorcost import error_roots


@pytest.mark.parametrize("role", ["receiver", "sharer_same"])  # Qwen2 (q bias) and Qwen3 (q_norm)
def test_roots_are_the_forms_square_roots_read_off_the_weights_and_the_queries(tiny_models, role):
    lm = tiny_models[role]
    config = lm.model.config
    ids = [lm.tokenizer(text, add_special_tokens=False)["input_ids"]
           for text in ("The river rose in spring.", "Bridges were built of stone and iron over many years.")]
    roots = error_roots(lm.model, ids)
    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    dim = lm.geometry.head_dim
    assert roots.shape == (layers, 2, kv_heads, dim, dim)
    assert np.allclose(roots, np.swapaxes(roots, -1, -2))
    forms = roots @ roots
    assert np.allclose(np.trace(forms, axis1=-2, axis2=-1) / dim, 1.0)  # scaled to mean eigenvalue 1

    # values: sum over the KV head's query heads of W_o,h^T W_o,h, up to scale
    group = heads // kv_heads
    for layer, block in enumerate(lm.model.model.layers):
        w_o = block.self_attn.o_proj.weight.detach().double().numpy()
        for g in range(kv_heads):
            cols = [w_o[:, h * dim:(h + 1) * dim] for h in range(g * group, (g + 1) * group)]
            want = sum(c.T @ c for c in cols)
            assert np.allclose(forms[layer, 1, g], want / (np.trace(want) / dim), atol=1e-6)

    # keys: diagonal, each rotary pair's two channels alike, in proportion to the queries' energy
    # (recomputed here from the hidden states the model returns, not through the codec's hook)
    energy = np.zeros((layers, kv_heads, dim))
    count = 0
    with torch.inference_mode():
        for seq in ids:
            out = lm.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
            for layer, block in enumerate(lm.model.model.layers):
                attn = block.self_attn
                q = attn.q_proj(block.input_layernorm(out.hidden_states[layer])).view(len(seq), heads, dim)
                if getattr(attn, "q_norm", None) is not None:
                    q = attn.q_norm(q)
                energy[layer] += q.double().pow(2).sum(0).reshape(kv_heads, group, dim).sum(1).numpy()
            count += len(seq)
    half = dim // 2
    paired = np.concatenate([(energy[..., :half] + energy[..., half:]) / 2] * 2, axis=-1)
    keys = forms[:, 0]
    assert np.allclose(keys, np.eye(dim) * np.diagonal(keys, axis1=-2, axis2=-1)[..., None])
    diag = np.diagonal(keys, axis1=-2, axis2=-1)
    assert np.allclose(diag, paired / paired.mean(-1, keepdims=True), rtol=1e-4)
