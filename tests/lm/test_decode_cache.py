"""The decode cache (`kvcache.to_decode_cache`): new tokens go into spare room, and the model reads
exactly what a concatenating `DynamicCache` would give it (tiny models)."""

import torch
from conftest import MIN_GREEDY_MARGIN

from cachegraft_cli.lm import kvcache


def _past(layers=4, batch=2, heads=2, tokens=9, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, heads, tokens, dim, generator=g), torch.randn(batch, heads, tokens, dim, generator=g))
            for _ in range(layers)]


def test_updates_match_concatenation_across_reallocations(tiny_models):
    config = tiny_models["receiver"].model.config
    past = _past()
    growing, plain = kvcache.to_decode_cache(past, config), kvcache.to_model_cache(past, config)
    layer = growing.layers[0]
    assert type(layer) is kvcache.growing_layer_class()
    room = layer.room[0]
    for step in range(layer.ROOM + 5):  # past the spare room: one reallocation
        new = _past(tokens=1 + step % 3, seed=step + 1)
        for i, (k, v) in enumerate(new):
            got, want = growing.layers[i].update(k, v), plain.layers[i].update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert layer.room[0].data_ptr() != room.data_ptr()  # it did grow
    assert kvcache.num_tokens(kvcache.from_model_cache(growing)) == kvcache.num_tokens(kvcache.from_model_cache(plain))


def test_replaced_tensors_get_a_new_buffer(tiny_models):
    config = tiny_models["receiver"].model.config
    cache = kvcache.to_decode_cache(_past(), config)
    layer = cache.layers[0]
    keep = layer.keys.clone()
    layer.batch_select_indices(torch.tensor([1]))  # transformers' own batch selection: a new tensor
    k, v = _past(batch=1, tokens=2, seed=9)[0]
    keys, _ = layer.update(k, v)
    assert keys.shape == (1, 2, 11, 16) and torch.equal(keys[:, :, :9], keep[1:]) and torch.equal(keys[:, :, 9:], k)
    layer.crop(-3)  # a crop keeps the pointer: the cropped slots are written again
    keys, _ = layer.update(k[:, :, :1], v[:, :, :1])
    assert keys.shape == (1, 2, 9, 16) and torch.equal(keys[:, :, 8:], k[:, :, :1])


def test_decoding_reads_the_same_cache(tiny_models, greedy_margins):
    from cachegraft_cli.lm.generation import GenerationOptions, Prompt, generate

    lm = tiny_models["receiver"]
    with torch.inference_mode():
        out = lm.model(input_ids=torch.arange(5, 30)[None], use_cache=True)
    past = kvcache.from_model_cache(out.past_key_values if hasattr(out, "past_key_values") else out.cache)
    prompt = Prompt.plain(past, list(range(30, 36)), 25)
    greedy = GenerationOptions(max_new_tokens=12)
    answer = generate(lm, prompt, greedy)
    real = kvcache.to_decode_cache
    try:  # the same answer through transformers' concatenating cache
        kvcache.to_decode_cache = lambda kv, config: kvcache.to_model_cache(kv, config) if kv else None
        plain = generate(lm, prompt, greedy)
    finally:
        kvcache.to_decode_cache = real
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # no near-tie: the same tokens on every CPU
    assert answer.token_ids == plain.token_ids and len(answer.token_ids) == 12
