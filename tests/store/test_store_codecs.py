"""Codecs: bf16 rounding, nominal and measured bytes per token at the target geometry."""

from __future__ import annotations

import numpy as np
import pytest
import reference_codecs
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from store_support import bf16_cache, identity, tc_calibration

from cachegraft_cli.store import CacheStore, PassageRow, codec_bytes_per_token, raw_bf16_bytes_per_token
from cachegraft_cli.store.codecs import CODECS, from_bf16_words, get_codec, to_bf16_words, unpack_bits
from cachegraft_cli.store.quantise import pack_bits

TARGET = {"layers": 24, "kv_heads": 2, "head_dim": 64}
LIMITS = {"int8": 0.52, "int4": 0.28}


def test_bf16_words_round_to_nearest_even_and_keep_specials():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -2.5, np.inf, -0.0], np.float32)
    back = from_bf16_words(to_bf16_words(x))
    # 1+2^-8 is a tie -> even (1.0); 1+3*2^-8 is a tie -> even (1+2^-6); just above a tie rounds up
    assert back.tolist()[:5] == [1.0, 1.0, 1.0 + 2**-6, 1.0 + 2**-7, -2.5]
    assert np.isinf(back[5]) and np.signbit(back[6])
    assert np.isnan(from_bf16_words(to_bf16_words(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_nominal_bytes_per_token_meet_targets(codec):
    ratio = codec_bytes_per_token(codec, TARGET) / raw_bf16_bytes_per_token(TARGET)
    assert ratio <= LIMITS[codec]
    assert codec_bytes_per_token("bf16", TARGET) == raw_bf16_bytes_per_token(TARGET) == 12288


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_measured_bytes_per_token_meet_targets(tmp_path, codec):
    rng = np.random.default_rng(5)
    shape = (24, 2, 2, 64)
    pool = bf16_cache(rng, 600, shape) * np.exp(rng.normal(0, 1, shape)).astype(np.float32)
    store = CacheStore.create(str(tmp_path / codec), identity(codec, TARGET, prefix_token_ids=[]),
                              np.zeros((0,) + shape, np.float32))
    with store.writer() as w:
        for i, n in enumerate([150, 120, 180, 140]):
            w.add(PassageRow(id=f"p{i}", content_hash=f"h{i}"), {"fused": pool[i * 100: i * 100 + n]})
    info = CacheStore.open(str(tmp_path / codec)).info()
    assert info["ratio_to_raw_bf16"]["fused"] <= LIMITS[codec]


def test_int4_needs_even_head_dim():
    from cachegraft_cli.errors import UsageError

    with pytest.raises(UsageError, match="even head_dim"):
        get_codec("int4", {"layers": 1, "kv_heads": 1, "head_dim": 7})


def test_default_shard_holds_whole_int4_key_groups(tmp_path):
    """A geometry so large that the byte target alone would give 64-token shards: the
    default shard grows to the int4 key group (a shard must hold whole groups)."""
    big = {"layers": 64, "kv_heads": 32, "head_dim": 256}
    store = CacheStore.create(str(tmp_path / "s"), identity("int4", big, prefix_token_ids=[]),
                              np.zeros((0, 64, 2, 32, 256), np.float32))
    assert store.meta["shard_tokens"] == get_codec("int4", big).kg == 128


# ---- every codec: round trips and properties (hypothesis) --------------------

SMALL = {"layers": 2, "kv_heads": 2, "head_dim": 16}
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOSSLESS = ("bf16", "float32")
# the largest |error| a codec allows, as a share of the block's max |x| (half a step of the coarsest
# scale, plus float16 rounding of scale and zero)
STEP = {"int8": 1 / 127, "int4": 1 / 15, "k2v4": 1 / 3, "int2": 1 / 3, "k8v4": 1 / 15}


def _block(seed: int, tokens: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, scale, size=(tokens, 2, 2, 2, 16)) * np.exp(rng.normal(0, 1, (2, 2, 2, 16)))
    return from_bf16_words(to_bf16_words(x.astype(np.float32)))


TC_SMALL = {"calibration": tc_calibration(SMALL)}  # the transform codec's bound: test_transform_codec.py


@PROPS
@given(st.sampled_from([c for c in CODECS if c != "tc"]), st.integers(0, 2**32 - 1), st.integers(1, 300),
       st.floats(1e-2, 1e2))
def test_every_codec_round_trips_within_its_bound(codec, seed, tokens, scale):
    x = _block(seed, tokens, scale)
    c = get_codec(codec, SMALL)
    parts = c.encode(x)
    assert {p.name for p in c.components()} == set(parts)
    for comp in c.components():
        assert parts[comp.name].dtype == np.dtype(comp.dtype)
        assert parts[comp.name].shape == (comp.rows(0, tokens)[1],) + comp.tail
    y = c.decode(parts, 0, tokens)
    assert y.shape == x.shape and y.dtype == np.float32
    if codec in LOSSLESS:
        assert np.array_equal(y, x)
    else:
        assert np.isfinite(y).all()
        assert np.abs(y - x).max() <= np.abs(x).max() * STEP[codec] * 1.01 + 1e-6


@PROPS
@given(st.sampled_from(CODECS), st.integers(0, 2**32 - 1), st.integers(2, 300), st.data())
def test_decoding_any_token_range_gives_the_same_values(codec, seed, tokens, data):
    """A read decodes only the rows a passage spans: the same values as decoding everything."""
    start = data.draw(st.integers(0, tokens - 1))
    stop = data.draw(st.integers(start + 1, tokens))
    c = get_codec(codec, SMALL, TC_SMALL if codec == "tc" else None)
    parts = c.encode(_block(seed, tokens, 1.0))
    whole = c.decode(parts, 0, tokens)
    sliced = {p.name: parts[p.name][slice(*p.rows(start, stop))] for p in c.components()}
    assert np.array_equal(c.decode(sliced, start, stop), whole[start:stop])


QUANTISED = [("int8", None), ("int4", None), ("int4", {"zero_point": False}), ("k2v4", None), ("int2", None),
             ("k8v4", None)]


@PROPS
@given(st.sampled_from(QUANTISED), st.integers(0, 2**32 - 1), st.integers(1, 300), st.floats(1e-3, 1e3),
       st.sampled_from(["plain", "bf16", "zero-keys", "zero-tokens"]))
def test_torch_encoders_give_the_numpy_reference_bytes(codec, seed, tokens, scale, shape):
    """The encoders run in torch on the cache's device; the bytes are those of the numpy encoders
    that wrote every earlier store (tests/store/reference_codecs.py), bit for bit: float16 scale
    and zero rounding, zero-scale groups, partial key groups, the symmetric int4 of old stores."""
    x = _block(seed, tokens, scale) if shape == "bf16" else \
        (np.random.default_rng(seed).normal(0, scale, (tokens, 2, 2, 2, 16))).astype(np.float32)
    if shape == "zero-keys":
        x[:, :, 0] = 0
    if shape == "zero-tokens":
        x[: max(1, tokens // 3)] = 0
    c = get_codec(codec[0], SMALL, codec[1])
    ours, reference = c.encode(x), reference_codecs.encode(c, x)
    assert set(ours) == set(reference)
    for name, part in reference.items():
        assert ours[name].dtype == part.dtype and ours[name].shape == part.shape
        assert ours[name].tobytes() == part.tobytes(), name
    assert {n: p.tobytes() for n, p in c.encode(torch.from_numpy(x)).items()} == {n: p.tobytes() for n, p in
                                                                                  ours.items()}


@PROPS
@given(st.sampled_from([2, 4]), st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_bit_packing_round_trips(bits, seed, groups):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(3, groups * 8 // bits), dtype=np.uint8)
    packed = pack_bits(torch.from_numpy(codes), bits).numpy()
    assert packed.shape == (3, groups) and np.array_equal(unpack_bits(packed, bits), codes)


@pytest.mark.parametrize("codec,limit", [("k2v4", 0.22), ("int2", 0.17)])
def test_lower_bit_codecs_nominal_and_measured_bytes(tmp_path, codec, limit):
    """Nominal bytes at the offline geometry, and what `store info` measures on a written store."""
    nominal = codec_bytes_per_token(codec, TARGET)
    assert nominal / raw_bf16_bytes_per_token(TARGET) <= limit
    rng = np.random.default_rng(5)
    shape = (24, 2, 2, 64)
    pool = bf16_cache(rng, 600, shape) * np.exp(rng.normal(0, 1, shape)).astype(np.float32)
    store = CacheStore.create(str(tmp_path / codec), identity(codec, TARGET, prefix_token_ids=[]),
                              np.zeros((0,) + shape, np.float32))
    with store.writer() as w:
        for i, n in enumerate([150, 120, 180, 140]):
            w.add(PassageRow(id=f"p{i}", content_hash=f"h{i}"), {"fused": pool[i * 100: i * 100 + n]})
    info = CacheStore.open(str(tmp_path / codec)).info()
    assert info["nominal_bytes_per_token"] == nominal and info["ratio_to_raw_bf16"]["fused"] <= limit


def test_lower_bit_codecs_refuse_unfit_settings():
    from cachegraft_cli.errors import UsageError

    with pytest.raises(UsageError, match="divisible by 4"):
        get_codec("int2", {"layers": 1, "kv_heads": 1, "head_dim": 6})
    with pytest.raises(UsageError, match="key_bits"):
        get_codec("k2v4", SMALL, {"key_bits": 3})
