"""Codecs: bf16 rounding, nominal and measured bytes per token at the target geometry."""

from __future__ import annotations

import numpy as np
import pytest
from store_support import bf16_cache, identity

from cachegraft_cli.store import CacheStore, PassageRow, codec_bytes_per_token, raw_bf16_bytes_per_token
from cachegraft_cli.store.codecs import from_bf16_words, get_codec, to_bf16_words

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
