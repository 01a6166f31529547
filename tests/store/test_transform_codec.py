"""The transform codec (`tc`): each stage round-trips, the entropy coder reproduces the symbols
exactly, the error stays within the steps it was coded at, and a tc store keeps its calibration:
checked, versioned (format 3) and used by every reader, append and compaction."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from store_support import GEOMETRY, identity, prefix, row, structured_cache, tc_calibration

from cachegraft_cli.errors import StoreError, StoreMetadataError, UsageError
from cachegraft_cli.store import CacheStore, transform as tf
from cachegraft_cli.store.codecs import get_codec
from cachegraft_cli.store.entropy import BandCoder, GroupCoder, bands, deflate_frame, inflate_frame, planes

PROPS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CAL = tc_calibration()
NEAREST = tc_calibration(deadzone=0.0, group=16)  # the rounding and groups of calibrations before 2026-12-06
# nonzero symbols only 0.7 steps from zero on
DEADZONE = tc_calibration(deadzone=0.2)
C = GEOMETRY["kv_heads"] * GEOMETRY["head_dim"]


def tc(cal=CAL):
    return get_codec("tc", GEOMETRY, {"calibration": cal})


def tc_store(url, cal=CAL, **kw) -> CacheStore:
    return CacheStore.create(url, identity("tc"), prefix(np.random.default_rng(0)), codec_params={"calibration": cal},
                             **kw)


# ---- the stages ------------------------------------------------------------------------


@PROPS
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.integers(1, 5))
def test_the_entropy_coder_reproduces_the_symbols_exactly(seed, tokens, classes):
    rng = np.random.default_rng(seed)
    klass = rng.integers(-1, classes, size=(3, 2, 7))
    radius = rng.integers(2, 40, size=classes)
    probs = [(lambda p: p / p.sum())(rng.random(2 * r + 1) + 1e-3) for r in radius]
    coder = GroupCoder(klass, probs, radius)
    limit = np.where(klass.reshape(-1) >= 0, radius[np.maximum(klass.reshape(-1), 0)], 0)
    symbols = rng.integers(-limit, limit + 1, size=(tokens, limit.size)).astype(np.int32)
    words = coder.encode(symbols)
    assert words.dtype == np.uint32
    assert np.array_equal(coder.decode(words, tokens), symbols)
    # the stream costs close to the models' ideal bits (ANS: within a couple of words)
    assert len(words) * 32 <= coder.cost_bits(symbols, probs).sum() + 96


@PROPS
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.integers(1, 6), st.sampled_from(BandCoder.FRAMES),
       st.floats(0, 1))
def test_the_band_coder_reproduces_the_symbols_exactly(seed, tokens, classes, frame, dense):
    rng = np.random.default_rng(seed)
    klass = rng.integers(-1, classes, size=(3, 2, 50))
    radius = rng.choice([1, 2, 3, 7, 9, 127, 128, 300, 32767], size=classes)  # int8 and int16 bands
    coder = BandCoder(klass, radius, frame, level=3)
    limit = np.where(klass.reshape(-1) >= 0, radius[np.maximum(klass.reshape(-1), 0)], 0)
    # mostly zeros, as real symbols are: a band's largest magnitude (how deflate frames pack) varies
    limit = np.minimum(limit, rng.integers(0, 8, size=limit.size)) if rng.random() < 0.5 else limit
    symbols = rng.integers(-limit, limit + 1, size=(tokens, limit.size)) * (rng.random((tokens, limit.size)) < dense)
    symbols = symbols.astype(np.int32)
    words = coder.encode(symbols)
    assert words.dtype == np.uint32
    assert np.array_equal(coder.decode(words, tokens), symbols)


@pytest.mark.parametrize("r", [0, 1, 2, 3, 7, 8, 127])
def test_a_deflate_frame_packs_small_symbols_and_reads_back_into_any_view(r):
    rng = np.random.default_rng(r)
    x = (rng.integers(-r, r + 1, size=(33, 64)) * (rng.random((33, 64)) < 0.3)).astype(np.int32)
    x[0, 0] = r  # the band's largest magnitude is r
    frame = deflate_frame(x, wide=False)
    assert frame[0] == r
    if 1 <= r <= 7:  # packed 2-5 to a byte: smaller than the same symbols one to a byte
        assert len(frame) < len(zlib.compress(planes(x, False), 9))
    out = np.full((33, 70), 99, np.int32)  # a strided view, as a short group's rows are
    inflate_frame(frame, False, out[:, :64])
    assert np.array_equal(out[:, :64], x) and (out[:, 64:] == 99).all()


def test_a_deflate_frame_with_symbols_beyond_its_range_or_length_is_refused():
    bad = bytes([1]) + _raw_deflate(bytes([250, 3]))  # 250 >= 3**5: not a packing of r = 1
    with pytest.raises(ValueError, match="beyond its range"):
        inflate_frame(bad, False, np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="holds 1 bytes"):
        inflate_frame(bytes([1]) + _raw_deflate(bytes([3])), False, np.zeros((2, 5), np.int32))


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


@PROPS
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(1, 300))
def test_bands_hold_every_coded_component_once_in_whole_classes_of_one_width(seed, classes, least):
    rng = np.random.default_rng(seed)
    klass = rng.integers(-1, classes, size=400)
    radius = rng.choice([2, 127, 128, 4000], size=classes)
    cut = bands(klass, radius, least)
    everything = np.concatenate(cut) if cut else np.zeros(0, np.int64)
    assert np.array_equal(np.sort(everything), np.flatnonzero(klass >= 0))
    owner = {}
    for b, members in enumerate(cut):
        assert len({bool(radius[c] > 127) for c in klass[members]}) == 1
        for c in np.unique(klass[members]):
            assert owner.setdefault(int(c), b) == b


@PROPS
@given(st.integers(0, 2**32 - 1), st.integers(1, 60), st.integers(0, 3000))
def test_rotation_is_undone_exactly_enough_and_preserves_norms(seed, tokens, start):
    keys = np.random.default_rng(seed).normal(0, 3, (tokens, 2, 2, 16)).astype(np.float32)
    inv = tf.inv_frequencies(1e6, 16)
    pos = start + np.arange(tokens)
    turned = tf.rotate(keys, pos, inv, 1)
    assert np.allclose(np.linalg.norm(turned, axis=-1), np.linalg.norm(keys, axis=-1), rtol=1e-5, atol=1e-5)
    assert np.allclose(tf.rotate(turned, pos, inv, -1), keys, atol=1e-4)


@PROPS
@given(st.integers(0, 2**32 - 1), st.integers(1, 50), st.floats(0.05, 20), st.sampled_from([CAL, NEAREST, DEADZONE]))
def test_analysis_and_synthesis_agree_and_stay_within_half_a_step(seed, tokens, scale, cal):
    """The decoder rebuilds, layer by layer, exactly what the encoder predicted from; unclamped
    tokens are within half a step of every coded component (1.5 of never-coded ones), plus the
    deadzone where the calibration has one."""
    rng = np.random.default_rng(seed)
    x = structured_cache(rng, tokens) * np.float32(scale)
    pos = 4 + np.arange(tokens)
    keys, values = tf.split(x, pos, cal.arrays["inv_freq"])
    scale_t = 2.0 ** rng.integers(0, 3, tokens)
    symbols, over = tf.analyse(cal, keys, values, scale_t)
    rk, rv = tf.synthesise(cal, symbols, scale_t)
    a, dz = cal.work, cal.deadzone
    for layer in range(GEOMETRY["layers"]):
        for kv, (orig, recon) in enumerate(((keys, rk), (values, rv))):
            step = a["step"][layer, kv] * scale_t[:, None]
            basis = a[f"basis.{layer}.{'kv'[kv]}"]
            # the error in the transform domain (the basis is orthonormal to float16 precision)
            err = np.abs(((orig[:, layer] - recon[:, layer]) @ basis) / step)[~over]
            coded = tf.radii(cal, layer, kv) > 0
            assert (err[:, coded] <= 0.5 + dz + 2e-2).all() and (err <= 1.5 + dz + 2e-2).all()
    # the reconstruction the writer's encoder makes is the decoder's, bit for bit
    again, _ = tf.analyse(cal, *tf.split(tf.join(rk, rv, pos, cal.arrays["inv_freq"], 2), pos,
                                          cal.arrays["inv_freq"]), scale_t)
    assert np.abs(again - symbols).max() <= 1  # re-analysing the rebuilt cache lands on (almost) the same symbols


def test_the_fit_is_deterministic_and_its_file_round_trips():
    again = tc_calibration()
    assert again.to_bytes() == CAL.to_bytes() and again.sha256 == CAL.sha256
    back = tf.Calibration.from_bytes(CAL.to_bytes())
    assert back.info == CAL.info and all(np.array_equal(back.arrays[k], v) for k, v in CAL.arrays.items())
    basis = CAL.work["basis.1.v"]
    assert np.allclose(basis.T @ basis, np.eye(C), atol=5e-3)  # a complete orthonormal basis


def test_the_deadzone_rounds_toward_zero():
    z = np.array([0.69, 0.71, -0.71, 1.69, 1.71, -2.2, 0.0])
    assert np.array_equal(tf.quantise(z, 0.2), [0, 1, -1, 1, 2, -2, 0])
    assert np.array_equal(tf.quantise(z), np.rint(z))


@PROPS
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.1, 0.2]))
def test_clamped_symbols_are_quantise_clipped_and_flag_what_it_clipped(seed, deadzone):
    rng = np.random.default_rng(seed)
    z = (rng.laplace(0, 2, (3, 7, 24)) * rng.choice([1, 10], (3, 7, 1))).astype(np.float32)
    z[0, 0, :4] = [0.5, -0.5, 1.5, -2.5]  # ties round to even without a deadzone
    limit = rng.integers(0, 6, 24).astype(np.float32)
    over = np.zeros((3, 7), bool)
    want = np.clip(tf.quantise(z, deadzone), -limit, limit)
    flagged = (np.abs(tf.quantise(z, deadzone)) > np.maximum(limit, 1)).any(-1)
    got = tf.clamped(z.copy(), deadzone, limit, np.maximum(limit, 1), over)
    assert got.dtype == np.float32 and np.array_equal(got, want) and np.array_equal(over, flagged)


def test_symbols_analysed_into_the_coders_order_are_the_dense_ones_reordered():
    x = structured_cache(np.random.default_rng(6), 48)
    keys, values = tf.split(x, np.arange(48), CAL.arrays["inv_freq"])
    keys, values = keys.reshape(3, 16, *keys.shape[1:]), values.reshape(3, 16, *values.shape[1:])
    scale = np.ones((3, 16))
    dense, over = tf.analyse(CAL, keys, values, scale)
    order = tc().coder().order
    coded = tf.Coded.empty(order, dense.shape[2:], 3, 16)
    _, over2 = tf.analyse(CAL, keys, values, scale, out=coded)
    assert np.array_equal(over, over2)
    assert np.array_equal(coded.buffer[:, :-1], dense.reshape(3, 16, -1)[:, :, order].swapaxes(1, 2))
    assert not coded.buffer[:, -1].any()  # never-coded components' zeros only


def test_a_deadzone_calibration_codes_fewer_nonzero_symbols_and_records_its_settings():
    x = structured_cache(np.random.default_rng(5), 40)
    keys, values = tf.split(x, 4 + np.arange(40), CAL.arrays["inv_freq"])
    plain, _ = tf.analyse(NEAREST, keys, values, np.ones(40))
    dz, _ = tf.analyse(DEADZONE, keys, values, np.ones(40))
    assert np.count_nonzero(dz) < 0.9 * np.count_nonzero(plain)
    # an encoder's choice: the format stays, every reader decodes it as any other
    assert DEADZONE.info["deadzone"] == 0.2 and DEADZONE.info["format"] == NEAREST.info["format"]
    assert "deadzone" not in NEAREST.info and NEAREST.deadzone == 0
    assert (CAL.deadzone, CAL.info["group"], NEAREST.info["group"]) == (0.1, 64, 16)  # today's defaults
    assert tf.Calibration.from_bytes(DEADZONE.to_bytes()).deadzone == 0.2
    c = tc(DEADZONE)
    assert np.sqrt(((c.decode(c.encode(x), 0, 40) - x) ** 2).mean() / (x**2).mean()) < 0.2
    with pytest.raises(ValueError, match="deadzone"):
        tc_calibration(deadzone=0.5)


def test_layer_steps_scale_each_layers_steps_and_are_recorded():
    multipliers = ((1.0, 2.0), (0.5, 1.0), (4.0, 0.25))
    weighted = tc_calibration(layer_steps=multipliers)
    ratio = weighted.arrays["step"] / CAL.arrays["step"]
    assert np.allclose(ratio, np.array(multipliers), rtol=1e-5)
    assert weighted.info["layer_steps"] == [list(m) for m in multipliers] and CAL.info["layer_steps"] is None
    x = structured_cache(np.random.default_rng(4), 30)
    c = get_codec("tc", GEOMETRY, {"calibration": weighted})
    assert np.sqrt(((c.decode(c.encode(x), 0, 30) - x) ** 2).mean() / (x**2).mean()) < 0.2
    for bad in (((1.0, 1.0),), ((1.0, 0.0), (1.0, 1.0), (1.0, 1.0))):
        with pytest.raises(ValueError, match="layer_steps"):
            tc_calibration(layer_steps=bad)


def roots(seed: int = 0, spread: float = 30.0, geometry: dict | None = None) -> np.ndarray:
    """Error forms' roots `(L, 2, H, D, D)`: random symmetric ones, eigenvalues `spread` apart."""
    g = geometry or GEOMETRY
    rng = np.random.default_rng(seed)
    out = np.zeros((g["layers"], 2, g["kv_heads"], g["head_dim"], g["head_dim"]))
    for idx in np.ndindex(out.shape[:3]):
        q, _ = np.linalg.qr(rng.standard_normal((g["head_dim"], g["head_dim"])))
        energy = spread ** np.linspace(-0.5, 0.5, g["head_dim"])
        out[idx] = (q * np.sqrt(energy / energy.mean())) @ q.T
    return out


def weighted_error(cal, caches: list[np.ndarray], forms: np.ndarray) -> float:
    """Mean |e S|^2 of passages' round trips through `cal` (keys un-rotated, S the head's root),
    relative to |x S|^2."""
    c = get_codec("tc", GEOMETRY, {"calibration": cal})
    cost = scale = 0.0
    for x in caches:
        pos = 4 + np.arange(len(x))

        def unrotated(cache, pos=pos):
            keys, values = tf.split(cache, pos, cal.arrays["inv_freq"])
            return np.stack([keys, values], 2).reshape(cache.shape)

        ref = unrotated(x)
        e = unrotated(c.decode(c.encode(x), 0, len(x))) - ref
        cost += float((np.einsum("tlkhd,lkhde->tlkhe", e, forms) ** 2).sum())
        scale += float((np.einsum("tlkhd,lkhde->tlkhe", ref, forms) ** 2).sum())
    return cost / scale


def test_a_weighted_fit_spends_its_error_where_it_costs_less():
    """With error forms, the fit works in the space where an error e costs |e S|^2: a new format
    that readers of the first one refuse, rebuilt through its own synthesis, and at the same bits
    its weighted error is below an unweighted fit's."""
    forms = roots()
    x = [structured_cache(np.random.default_rng(s), 50) for s in (100, 101)]
    settings = tf.FitOptions(rope_theta=10000.0, position_offset=4)
    caches = [structured_cache(np.random.default_rng(s), 50) for s in range(12)]
    plain = tf.fit_to_ratio(caches, settings, 0.1, source="tests")
    weighted = tf.fit_to_ratio(caches, settings, 0.1, source="tests", roots=forms, weighting="tests")
    assert plain.info["format"] == tf.FORMAT and weighted.info["format"] == tf.WEIGHTED_FORMAT != tf.FORMAT
    assert weighted.info["weighting"] == "tests" and "synthesis.0.k" in weighted.arrays
    assert not any(k.startswith("synthesis.") for k in plain.arrays)
    assert abs(weighted.info["bits_per_element"] - plain.info["bits_per_element"]) < 0.1
    back = tf.Calibration.from_bytes(weighted.to_bytes())
    assert weighted_error(back, x, forms) < 0.8 * weighted_error(plain, x, forms)
    synthesis, analysis = back.work["synthesis.1.v"], back.work["basis.1.v"]
    assert np.allclose(analysis @ synthesis, np.eye(C), atol=2e-2)  # the synthesis undoes the analysis
    with pytest.raises(ValueError, match="roots"):
        tf.fit(caches, settings, roots=forms[:, :, :1])


def test_a_file_that_is_not_a_calibration_is_refused():
    with pytest.raises(StoreMetadataError, match="does not read"):
        tf.Calibration.from_bytes(b"not safetensors")
    from safetensors.numpy import save

    with pytest.raises(StoreMetadataError, match="format"):
        tf.Calibration.from_bytes(save({"a": np.zeros(2)}, metadata={"cachegraft": json.dumps({"format": "x/9"})}))


@pytest.mark.parametrize("ablation", [{"predict": False}, {"transform": False}])
def test_ablations_fit_and_round_trip(ablation):
    cal = tc_calibration(**ablation)
    assert not any(k.startswith("map.") for k in cal.arrays) if not ablation.get("predict", True) else True
    if not ablation.get("transform", True):
        assert np.array_equal(cal.work["basis.0.k"], np.eye(C, dtype=np.float32))
    x = structured_cache(np.random.default_rng(3), 30)
    c = tc(cal)
    y = c.decode(c.encode(x), 0, 30)
    assert np.sqrt(((y - x) ** 2).mean() / (x**2).mean()) < 0.15


# ---- the codec -------------------------------------------------------------------------


@PROPS
@given(st.integers(0, 2**32 - 1), st.integers(1, 80), st.floats(1e-2, 1e3), st.booleans(),
       st.sampled_from([CAL, NEAREST]))
def test_every_error_is_within_one_and_a_half_of_its_groups_steps(seed, tokens, scale, structured, cal):
    """Caches like the calibration's or not (Gaussian noise, any scale): groups whose code would
    not fit, or would clamp, are coded at coarser steps, and every component stays within 1.5
    of its group's steps plus the calibration's deadzone (the bound a reader can rely on), in each
    layer's own basis."""
    rng = np.random.default_rng(seed)
    x = structured_cache(rng, tokens) if structured else rng.normal(0, 1, (tokens,) + (3, 2, 2, 8))
    x = (x * scale).astype(np.float32)
    c = tc(cal)
    parts = c.encode(x)
    y = c.decode(parts, 0, tokens)
    assert y.shape == x.shape and y.dtype == np.float32 and np.isfinite(y).all()
    shift = np.repeat(parts["head"][:, 2], parts["head"][:, 1]).astype(np.float64)
    pos = 4 + np.arange(tokens)
    kx, vx = tf.split(x, pos, cal.arrays["inv_freq"])
    ky, vy = tf.split(y, pos, cal.arrays["inv_freq"])
    for layer in range(GEOMETRY["layers"]):
        for kv, (a, b) in enumerate(((kx, ky), (vx, vy))):
            step = cal.work["step"][layer, kv] * 2.0 ** shift[:, None]
            err = ((a[:, layer] - b[:, layer]) @ cal.work[f"basis.{layer}.{'kv'[kv]}"]) / step
            assert np.abs(err).max() <= 1.5 + cal.deadzone + 2e-2
    if structured and scale < 1.5:
        # caches like the calibration's fit at its own steps (from about 1.75x its scale on, a rare
        # token past a class's radius codes its group coarser: 2,100 draws, 16- and 64-token groups)
        assert (shift == 0).all()


def test_caches_unlike_the_calibration_are_coded_coarser_not_refused():
    x = structured_cache(np.random.default_rng(1), 40) * np.float32(300)
    parts = tc().encode(x)
    assert (parts["head"][:, 2] > 0).all()
    with pytest.raises(StoreError, match="NaN"):
        tc().encode(np.full((3, 3, 2, 2, 8), np.nan, np.float32))


def test_a_passage_reads_the_same_from_its_position_in_any_group():
    """Groups are 16 tokens: a read of any token range decodes whole groups and keeps its slice."""
    x = structured_cache(np.random.default_rng(2), 70)
    c = tc()
    parts = c.encode(x)
    whole = c.decode(parts, 0, 70)
    for start, stop in [(0, 1), (15, 17), (16, 32), (33, 70), (69, 70)]:
        sliced = {p.name: parts[p.name][slice(*p.rows(start, stop))] for p in c.components()}
        assert np.array_equal(c.decode(sliced, start, stop), whole[start:stop])


def test_a_new_tc_store_codes_with_deflate_bands_and_other_stages_are_refused():
    c = tc()
    assert (c.entropy, c.params["entropy"], "level" in c.params) == ("deflate", "deflate", False)
    for bad in ({"entropy": "lzma"}, {"level": 0}, {"level": "high"}):
        with pytest.raises(UsageError, match="entropy stage"):
            get_codec("tc", GEOMETRY, {"calibration": CAL, **bad})
    x = structured_cache(np.random.default_rng(3), 40)
    mine = c.decode(c.encode(x), 0, 40)
    for older in ({"entropy": "ans"}, {"entropy": "zstd", "level": 15}):
        codec = get_codec("tc", GEOMETRY, {"calibration": CAL, **older})
        # the same symbols through any entropy stage: the same caches back
        assert np.array_equal(codec.decode(codec.encode(x), 0, 40), mine)


def test_tc_needs_a_calibration():
    with pytest.raises(UsageError, match="calibration"):
        get_codec("tc", GEOMETRY)
    with pytest.raises(StoreMetadataError, match="geometry"):
        get_codec("tc", {"layers": 2, "kv_heads": 2, "head_dim": 8}, {"calibration": CAL})


# ---- the store -------------------------------------------------------------------------


def _fill(store, seed=0, n=6):
    rng = np.random.default_rng(seed)
    data = {f"p{seed}-{i}" if seed else f"p{i}": structured_cache(rng, int(rng.integers(5, 60))) for i in range(n)}
    with store.writer() as w:
        for pid, x in data.items():
            w.add(row(0, id=pid, content_hash=pid), {"fused": x})
    return data


def test_a_tc_store_reads_what_the_codec_decodes_per_passage(tmp_path):
    url = str(tmp_path / "s")
    data = _fill(tc_store(url, shard_tokens=64, chunk_tokens=16))
    store = CacheStore.open(url)
    c = tc()
    for x, got in zip(data.values(), store.read(list(data))):
        # positions restart at each passage; the store's groups of 16 are not the passage's own, so
        # the same symbols up to a rare rounding tie (float products are exact per group, not per token)
        alone = c.decode(c.encode(x), 0, len(x))
        assert np.abs(got - alone).mean() <= 1e-3 * np.abs(x).mean()
        assert np.sqrt(((got - x) ** 2).mean() / (x**2).mean()) < 0.12
    assert store.verify()["ok"]
    info = store.info()
    assert info["format_version"] == 4 and info["codec"] == "tc"
    tables = info["codec_tables"]
    assert tables["sha256"] == CAL.sha256 and tables["bytes"] == len(CAL.to_bytes())
    assert tables["weighting"] == CAL.info.get("weighting") and tables["layer_steps"] is False
    assert (tmp_path / "s" / tables["file"]).read_bytes() == CAL.to_bytes()


def test_reading_passages_together_gives_what_reading_each_alone_gives(tmp_path):
    url = str(tmp_path / "s")
    data = _fill(tc_store(url, shard_tokens=64, chunk_tokens=16), n=7)
    store = CacheStore.open(url)
    together = store.read(list(data))  # their groups rebuilt in one batch, split between threads
    for pid, got in zip(data, together):
        assert np.array_equal(got, store.read([pid])[0])


@pytest.mark.parametrize("threads", [2, 3])
def test_decoding_on_several_threads_gives_the_bits_of_one(tmp_path, threads):
    """A read's groups and passages are split between torch's threads: no bit may depend on the split."""
    import torch

    url = str(tmp_path / "s")
    data = _fill(tc_store(url, shard_tokens=64, chunk_tokens=16), n=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = CacheStore.open(url).read(list(data))
        torch.set_num_threads(threads)
        several = CacheStore.open(url).read(list(data))
    finally:
        torch.set_num_threads(before)
    assert len(one) == len(several) == len(data)
    for a, b in zip(one, several):
        assert a.dtype == np.float32 and np.array_equal(a, b)


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("build, entropy", [("tc_ans", "ans"), ("tc_zstd", "zstd")])
def test_a_tc_store_of_an_earlier_build_reads_and_appends_as_before(tmp_path, build, entropy):
    """The first build's store (ANS, no `entropy` key) and a zstd-band build's."""
    url = str(tmp_path / "s")
    shutil.copytree(FIXTURES / build / "store", url)
    expected = np.load(FIXTURES / build / "expected.npz")
    store = CacheStore.open(url)
    stored = dict(store.codec.params)
    assert store.codec.entropy == entropy and stored.get("entropy") == (None if entropy == "ans" else entropy)
    ids = sorted(k.split(".", 1)[1] for k in expected.files if k.startswith("input."))
    for pid, got in zip(ids, store.read(ids)):
        # the symbols that build stored; its float products summed in another order (rounding only)
        scale = np.abs(expected[f"input.{pid}"]).max()
        assert np.allclose(got, expected[f"decoded.{pid}"], rtol=0, atol=1e-5 * scale)
    assert store.verify()["ok"]
    more = _fill(store, seed=5, n=2)  # appended with the store's own stage
    again = CacheStore.open(url)
    assert dict(again.codec.params) == stored and again.verify()["ok"]
    for x, got in zip(more.values(), again.read(list(more))):
        assert np.sqrt(((got - x) ** 2).mean() / (x**2).mean()) < 0.12


def test_appends_and_compaction_keep_the_calibration_and_the_caches(tmp_path):
    from cachegraft_cli.store.compact import compact

    url = str(tmp_path / "s")
    tc_store(url)
    for seed in range(3):
        _fill(CacheStore.open(url), seed, 3)  # three segments of three passages
    before = dict(zip(*(lambda s: (s.ids(), s.read(s.ids())))(CacheStore.open(url))))
    compact(url)
    after = CacheStore.open(url)
    assert len(after.segments) == 1
    for pid, x in zip(after.ids(), after.read(after.ids())):
        assert np.array_equal(x, before[pid])
    assert after.verify()["ok"]


def test_a_store_with_a_missing_or_tampered_calibration_is_refused(tmp_path):
    url = str(tmp_path / "s")
    _fill(tc_store(url), n=2)
    path = tmp_path / "s" / tc().calibration_path
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(StoreMetadataError, match="sha256"):
        CacheStore.open(url).read(["p0"])
    path.unlink()
    with pytest.raises(StoreMetadataError, match="does not read"):
        CacheStore.open(url).read(["p0"])
    path.write_bytes(data)
    assert CacheStore.open(url).verify()["ok"]


@pytest.mark.parametrize("reads_up_to", [2, 3])
def test_a_build_that_reads_an_older_format_refuses_the_stores_it_cannot_read(tmp_path, monkeypatch, reads_up_to):
    """A deflate tc store is format 4, a zstd one 3, others 2: a build reading up to 2 refuses
    both tc stores, one reading up to 3 (2026-12-04 to 2026-12-06) the deflate store only."""
    from cachegraft_cli.store import evidence, segments, store as store_mod

    urls = {name: str(tmp_path / name) for name in ("deflate", "zstd", "int8")}
    _fill(tc_store(urls["deflate"]), n=2)
    shutil.copytree(FIXTURES / "tc_zstd" / "store", urls["zstd"])
    CacheStore.create(urls["int8"], identity("int8"), prefix(np.random.default_rng(0)))
    versions = {name: CacheStore.open(url).meta["format_version"] for name, url in urls.items()}
    assert versions == {"deflate": 4, "zstd": 3, "int8": 2}
    for module in (store_mod, evidence, segments):
        monkeypatch.setattr(module, "FORMAT_VERSION", reads_up_to)
    for name, url in urls.items():
        if versions[name] <= reads_up_to:
            assert CacheStore.open(url).meta["format_version"] == versions[name]
        else:
            with pytest.raises(StoreError, match="format_version"):
                CacheStore.open(url)


def test_a_new_store_takes_a_calibration_for_its_own_geometry_only(tmp_path):
    other = tc_calibration({"layers": 2, "kv_heads": 2, "head_dim": 8})
    with pytest.raises(StoreMetadataError, match="geometry"):
        tc_store(str(tmp_path / "s"), other)
    assert not (tmp_path / "s" / "zarr.json").exists()


def test_a_ratio_target_scales_both_steps_to_meet_it_on_the_calibration_passages():
    rng = np.random.default_rng(4)
    caches = [structured_cache(rng, 50) for _ in range(12)]
    settings = tf.FitOptions(rope_theta=10000.0, position_offset=4)
    base = tf.fit(caches, settings)
    for ratio in (0.05, 0.2):
        cal = tf.fit_to_ratio(caches, settings, ratio)
        assert cal.info["key_step"] / cal.info["value_step"] == pytest.approx(0.25 / 0.35, rel=1e-3)
        # within one bisection step of the target (the last factor is 16^(2/2^7) = 1.09 wide)
        assert cal.info["bits_per_element"] <= 16 * ratio * 1.02
    assert base.info["bits_per_element"] > 0


def test_store_verify_names_a_tampered_calibration_and_exits_7(tmp_path):
    from typer.testing import CliRunner

    from cachegraft_cli.cli.app import app
    from cachegraft_cli.cli.errors import report

    url = str(tmp_path / "s")
    _fill(tc_store(url), n=2)
    path = tmp_path / "s" / tc().calibration_path
    path.write_bytes(path.read_bytes()[:-8])
    result = CliRunner().invoke(app, ["store", "verify", url])
    assert isinstance(result.exception, StoreMetadataError) and report(result.exception) == 7
    assert "codec tables" in result.output and "calibration" in str(result.exception)
