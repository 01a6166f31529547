"""The transform codec's calibration: what turns a cache into few, nearly independent integers.

Per layer, for keys (RoPE removed) and values separately, fitted once on calibration caches:

1. prediction: keys from the previous layer's *reconstructed* keys, values from the layer's own
   reconstructed keys and the previous layer's reconstructed values (ridge least squares), so a
   decoder that has rebuilt layer l-1 predicts layer l exactly as the encoder did;
2. a decorrelating transform: the PCA basis of the prediction residuals;
3. one uniform quantiser step per layer and K/V, a multiple of that layer's RMS spread, so that
   components with little variance fall to zero by themselves;
4. static entropy models: every coded component belongs to one of a few classes by the spread of
   its symbols, and each class has one histogram (`entropy.py` codes with it). Components whose
   calibration symbols were all zero are not coded at all (always zero).

All numpy (readers load no torch). The calibration is one safetensors file, identified by its
sha256 (docs/store-format.md, "Transform codec").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

FORMAT = "cachegraft-tc-calibration/1"
# a calibration whose error is weighted by what it costs the model (`synthesis.*` arrays): readers
# that know only FORMAT refuse it instead of rebuilding with the analysis matrix's transpose
WEIGHTED_FORMAT = "cachegraft-tc-calibration/2"
FORMATS = (FORMAT, WEIGHTED_FORMAT)
RIDGE = 1e-4  # the prediction's ridge, relative to the context's mean energy: well-posed on few tokens
CLASSES_PER_OCTAVE = 4  # entropy classes by the symbols' spread: 1/4 octave apart
SPREAD_RANGE = (-8.0, 10.0)  # log2 spreads beyond are put in the end classes
MAX_RADIUS = 32767  # symbols are int16 at most; beyond a class's radius they are clamped


@dataclass
class Calibration:
    """A fitted transform codec. `arrays` hold per layer and K/V (`k`, `v`): `map.{l}.{k}`
    (context + 1, C), `mean.{l}.{k}` (C,), `basis.{l}.{k}` (C, C) (the analysis matrix; with
    `synthesis.{l}.{k}` (C, C), rebuilt through that, else through its transpose); and `step` (L, 2),
    `inv_freq` (D/2,), `klass` (L, 2, C) int16 (-1: never coded), `counts` (classes, 2R+1)
    int64 histograms, `radius` (classes,) int32. `info` is the file's JSON metadata."""

    arrays: dict
    info: dict
    _bytes: bytes | None = field(default=None, repr=False)
    _work: dict | None = field(default=None, repr=False)

    @property
    def work(self) -> dict:
        """The arrays as computed with: float16 tables widened to float32 once."""
        if self._work is None:
            self._work = Widened(self.arrays)
        return self._work

    @property
    def deadzone(self) -> float:
        """How much further than half a step a coefficient must lie from zero to be coded nonzero."""
        return float(self.info.get("deadzone") or 0.0)

    @property
    def layers(self) -> int:
        return int(self.info["geometry"]["layers"])

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        if self._bytes is None:
            self._bytes = save({k: np.ascontiguousarray(v) for k, v in sorted(self.arrays.items())},
                               metadata={"cachegraft": json.dumps(self.info, sort_keys=True)})
        return self._bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Calibration":
        from safetensors.numpy import load

        from cachegraft_cli.errors import StoreMetadataError

        try:
            arrays = load(data)
            info = json.loads(_metadata(data)["cachegraft"])
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same refusal
            raise StoreMetadataError(f"transform-codec calibration does not read: {exc}",
                                     hint="Restore the file from a backup, or re-encode the store.") from None
        if info.get("format") not in FORMATS:
            raise StoreMetadataError(f"transform-codec calibration has format {info.get('format')!r}, this cachegraft "
                                     f"reads {', '.join(map(repr, FORMATS))}.", hint="Upgrade cachegraft.")
        return cls(arrays, info, data)

    # -- the models -------------------------------------------------------------

    def class_probabilities(self) -> list[np.ndarray]:
        """Each class's symbol probabilities over -R..R (add-half smoothed), float64, from the
        stored integer counts: the encoder and every decoder derive the very same tables."""
        out = []
        counts, radius = self.arrays["counts"], self.arrays["radius"]
        centre = (counts.shape[1] - 1) // 2
        for c, r in enumerate(radius.tolist()):
            row = counts[c, centre - r: centre + r + 1].astype(np.float64) + 0.5
            out.append(row / row.sum())
        return out


class Widened(dict):
    """A view of stored arrays with float16 ones widened to float32 on first use."""

    def __init__(self, stored: dict):
        super().__init__()
        self.stored = stored

    def __missing__(self, key):
        kind, _, rest = key.partition(".")
        if kind == "scaled":  # the synthesis (basis.T) times the step: symbols straight to the layer's units
            layer, name = rest.split(".")
            synthesis = self[f"synthesis.{rest}"] if f"synthesis.{rest}" in self.stored else self[f"basis.{rest}"].T
            value = np.ascontiguousarray(synthesis * self["step"][int(layer), "kv".index(name)])
        elif kind == "radius":  # each component's largest symbol (`radii`) and the clamp flag's threshold
            layer, name = rest.split(".")
            limit = radii_of(self.stored, int(layer), "kv".index(name)).astype(np.float32)
            value = (limit, np.maximum(limit, np.float32(1)))
        elif kind == "const":  # the mean plus the prediction's bias: one addition
            m = self.get(f"map.{rest}")
            value = self[f"mean.{rest}"] + (m[-1] if m is not None else 0)
        else:
            value = self.stored[key]
            value = value.astype(np.float32) if value.dtype == np.float16 else value
        self[key] = value
        return value

    def get(self, key, default=None):
        return self[key] if key in self.stored else default


def _metadata(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8: 8 + n]).get("__metadata__", {})


# ---------------------------------------------------------------- RoPE


def inv_frequencies(theta: float, head_dim: int) -> np.ndarray:
    """Rotate-half RoPE's per-pair frequencies (Qwen2/3, Llama). Any angles work as long as encoder
    and decoder use the same ones; the model's own make the keys most predictable."""
    return (float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float64)


def rotate(keys: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, sign: int) -> np.ndarray:
    """Keys `(tokens, layers, heads, dim)` float32 rotated by `sign` times their positions' angles."""
    angle = np.outer(positions.astype(np.float64), inv_freq)
    cos = np.cos(angle).astype(np.float32)[:, None, None, :]
    sin = (np.sin(angle) * sign).astype(np.float32)[:, None, None, :]
    half = keys.shape[-1] // 2
    lo, hi = keys[..., :half], keys[..., half:]
    out = np.empty(keys.shape, np.float32)
    np.subtract(lo * cos, hi * sin, out=out[..., :half])
    np.add(hi * cos, lo * sin, out=out[..., half:])
    return out


# ---------------------------------------------------------------- the per-layer pipeline


def split(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A cache block `(T, L, 2, H, D)` as un-rotated keys and values, each `(T, L, H*D)` float32."""
    t, layers = x.shape[:2]
    keys = rotate(np.asarray(x[:, :, 0], np.float32), positions, inv_freq, -1)
    return keys.reshape(t, layers, -1), np.ascontiguousarray(x[:, :, 1], np.float32).reshape(t, layers, -1)


def join(keys: np.ndarray, values: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, heads: int) -> np.ndarray:
    t, layers = keys.shape[:2]
    out = np.empty((t, layers, 2, heads, keys.shape[2] // heads), np.float32)
    out[:, :, 0] = rotate(keys.reshape(t, layers, heads, -1), positions, inv_freq, 1)
    out[:, :, 1] = values.reshape(t, layers, heads, -1)
    return out


def context(recon_k: np.ndarray, recon_v: np.ndarray, layer: int, kv: int) -> np.ndarray | None:
    """What layer `layer`'s keys (kv=0) or values (kv=1) are predicted from (`(..., L, C)` arrays):
    the rows of its map, in order, before the bias row."""
    if kv == 0:
        return recon_k[..., layer - 1, :] if layer else None
    return np.concatenate([recon_k[..., layer, :]] + ([recon_v[..., layer - 1, :]] if layer else []), axis=-1)


def predict(arrays: dict, layer: int, kv: int, recon_k: np.ndarray, recon_v: np.ndarray) -> np.ndarray | float:
    """The prediction of layer `layer`'s keys or values from what was rebuilt before them, without
    the map's bias (`const` holds it); 0 where there is no map. One product per context part
    (the same sum as `context(...) @ map[:-1]`, without assembling the context)."""
    m = arrays.get(f"map.{layer}.{'kv'[kv]}")
    if m is None:
        return 0.0
    if kv == 0:
        return recon_k[..., layer - 1, :] @ m[:-1]
    c = recon_k.shape[-1]
    out = recon_k[..., layer, :] @ m[:c]
    if layer:
        out += recon_v[..., layer - 1, :] @ m[c:-1]
    return out


def analyse(cal: Calibration, keys: np.ndarray, values: np.ndarray, scale: np.ndarray,
            out=None) -> tuple[np.ndarray, np.ndarray]:
    """Symbols `(..., L, 2, C)` int32 of un-rotated keys and values `(..., L, C)`, each token's
    steps times `scale` `(...)`, clamped as the classes require (so `synthesise` rebuilds what was
    predicted from), and which tokens were clamped `(...)`: a coded component beyond its class's
    radius, or a never-coded one at 1.5 steps or more (plus the deadzone). Unclamped, every coded
    component is within half a step plus the deadzone, and every never-coded one within 1.5 plus
    the deadzone. Leading dimensions are computed as stacks
    (`(groups, tokens)`: one matrix product per group, so a token's result depends on its group alone).
    `out`: where the symbols go instead (a `Coded` for `(groups, tokens)`: in the entropy stage's order)."""
    a = cal.work
    lead, (layers, c) = keys.shape[:-2], keys.shape[-2:]
    out = np.zeros(lead + (layers, 2, c), np.int32) if out is None else out
    over = np.zeros(lead, bool)
    # the rebuilt layers layer-major (each layer's rows contiguous), read as `(..., L, C)` views
    rk, rv = np.empty((layers,) + lead + (c,), np.float32), np.empty((layers,) + lead + (c,), np.float32)
    tk, tv = np.moveaxis(rk, 0, -2), np.moveaxis(rv, 0, -2)
    for layer in range(layers):
        for kv, (x, recon) in enumerate(((keys, rk), (values, rv))):
            name = "kv"[kv]
            pred = predict(a, layer, kv, tk, tv)
            z = x[..., layer, :] - pred
            z -= a[f"const.{layer}.{name}"]
            z = z @ a[f"basis.{layer}.{name}"]
            z /= (a["step"][layer, kv] * scale[..., None]).astype(np.float32)
            limit, flag = a[f"radius.{layer}.{name}"]
            q = clamped(z, cal.deadzone, limit, flag, over)
            out[..., layer, kv, :] = q
            rebuild(a, layer, kv, q, scale, pred, out=recon[layer])
    return out, over


def clamped(z: np.ndarray, deadzone: float, limit: np.ndarray, flag: np.ndarray, over: np.ndarray) -> np.ndarray:
    """`quantise(z, deadzone)` clipped to +-`limit` (float32 per component), as float32 whole
    numbers, computed in place in `z`; tokens with a symbol beyond `flag` (the limit, at least 1)
    are marked in `over`. (The same numbers as clipping `quantise`'s, in fewer passes.)"""
    if not deadzone:
        np.rint(z, out=z)
    sign = z.copy()
    np.abs(z, out=z)
    if deadzone:
        z += np.float32(0.5 - deadzone)
        np.floor(z, out=z)
    over |= (z > flag).any(-1)
    np.minimum(z, limit, out=z)
    return np.copysign(z, sign, out=z)


@dataclass
class Coded:
    """Groups' symbols as the entropy stage leaves them: `buffer` `(groups, rows + 1, tokens)`,
    per group one row per coded component in class order and a last row of zeros; `rows`
    `(L, 2, C)` each component's row (never-coded ones: the zero row). Saves scattering them
    into `(groups, tokens, L, 2, C)` first."""

    buffer: np.ndarray
    rows: np.ndarray

    @classmethod
    def empty(cls, order: np.ndarray, shape: tuple, groups: int, tokens: int, dtype=np.int16) -> "Coded":
        rows = np.full(int(np.prod(shape)), len(order), np.int64)
        rows[order] = np.arange(len(order))
        return cls(np.zeros((groups, len(order) + 1, tokens), dtype), rows.reshape(shape))

    def __getitem__(self, key) -> np.ndarray:
        """`coded[..., layer, kv, :]`: that layer's keys' or values' symbols `(groups, tokens, C)`."""
        _, layer, kv, _ = key
        return self.buffer[:, self.rows[layer, kv]].swapaxes(1, 2)

    def __setitem__(self, key, value: np.ndarray) -> None:
        """`coded[..., layer, kv, :] = symbols` `(groups, tokens, C)` (whole numbers; never-coded
        components' zeros land in the zero row)."""
        _, layer, kv, _ = key
        self.buffer[:, self.rows[layer, kv]] = value.swapaxes(1, 2)

    @property
    def shape(self) -> tuple:
        return (self.buffer.shape[0], self.buffer.shape[2]) + self.rows.shape


def synthesise(cal: Calibration, symbols, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Un-rotated keys and values `(..., L, C)` from symbols `(..., L, 2, C)` (an array or `Coded`):
    layer by layer, each predicted from what was rebuilt before it (leading dimensions as in `analyse`)."""
    a = cal.work
    lead, (layers, c) = symbols.shape[:-3], (symbols.shape[-3], symbols.shape[-1])
    # layer-major while rebuilding (each layer's rows contiguous), returned as `(..., L, C)` views
    rk, rv = np.empty((layers,) + lead + (c,), np.float32), np.empty((layers,) + lead + (c,), np.float32)
    tk, tv = np.moveaxis(rk, 0, -2), np.moveaxis(rv, 0, -2)
    for layer in range(layers):
        for kv, recon in enumerate((rk, rv)):
            rebuild(a, layer, kv, symbols[..., layer, kv, :], scale, predict(a, layer, kv, tk, tv), out=recon[layer])
    return tk, tv


def quantise(z: np.ndarray, deadzone: float = 0.0) -> np.ndarray:
    """Coefficients in steps to whole symbols: nearest, or with `deadzone` > 0 toward zero unless
    at least `0.5 + deadzone` steps beyond a level (fewer nonzero symbols, which cost the most bits)."""
    if not deadzone:
        return np.rint(z)
    return np.copysign(np.floor(np.abs(z) + (0.5 - deadzone)), z)


def rebuild(a: dict, layer: int, kv: int, q: np.ndarray, scale: np.ndarray, pred, out=None) -> np.ndarray:
    """A layer's keys or values from their symbols `q` `(..., C)` at steps times `scale` `(...)`
    (into `out`, a contiguous float32 array, when given)."""
    name = "kv"[kv]
    x = np.matmul(q if q.dtype == np.float32 else q.astype(np.float32), a[f"scaled.{layer}.{name}"], out=out)
    if (scale != 1).any():  # groups coded at coarser steps (rare): their symbols are in larger units
        x *= scale[..., None].astype(np.float32)
    x += a[f"const.{layer}.{name}"]
    if not isinstance(pred, float):
        x += pred
    return x


def radii(cal: Calibration, layer: int, kv: int) -> np.ndarray:
    """Each component's largest symbol: its class's radius; 0 for never-coded components."""
    return radii_of(cal.arrays, layer, kv)


def radii_of(arrays: dict, layer: int, kv: int) -> np.ndarray:
    klass = arrays["klass"][layer, kv].astype(np.int64)  # (stored int16)
    return np.where(klass >= 0, arrays["radius"][np.maximum(klass, 0)], 0)


# ---------------------------------------------------------------- fitting


@dataclass(frozen=True)
class FitOptions:
    # keys' quantiser step in units of the layer's RMS spread; the values' likewise. The defaults
    # are the smallest measured rate at int4's fidelity or better (docs/results.md, "Store size")
    key_step: float = 0.25
    value_step: float = 0.35
    rope_theta: float | None = None  # None: 10,000 (`encoding.calibration` reads the receiver's)
    position_offset: int = 0  # a passage's first token's position (the template prefix's length)
    # tokens per entropy-coded group (the codec's read granularity): 64 codes 3% smaller than 16
    # and decodes faster (fewer, larger frames and products; docs/results.md, "Store size")
    group: int = 64
    predict: bool = True  # False, True: the ablations of docs/results.md
    transform: bool = True
    # code rows hold this times the calibration's costliest group: a 64-token group's cost varies
    # less than a 16-token one's, so its costliest is nearer the typical one, and caches up to twice
    # the calibration's scale still need to fit (zero padding costs nothing stored: zarr compresses it)
    headroom: float = 2.0
    # per layer, the key and value steps' multipliers ((L, 2) nested; None: all 1): steps where
    # errors cost the model less made coarser (benchmarks/layer_sensitivity.py measures them)
    layer_steps: tuple | None = None
    # steps beyond half a step a coefficient must reach to be coded nonzero (0: the nearest symbol);
    # an encoder's choice that decoders need not know. 0.1 codes 3% smaller than 0 at the same
    # weighted error; rebuilding nonzero symbols nearer zero as well did not pay (docs/results.md)
    deadzone: float = 0.1


def fit(caches: list[np.ndarray], settings: FitOptions, source: str = "", roots: np.ndarray | None = None,
        weighting: str | None = None) -> Calibration:
    """Fit on passages' float32 caches `(T, L, 2, H, D)` (their tokens at positions offset + 0, 1, ...).
    With `roots` `(L, 2, H, D, D)` (`lm.errorcost.error_roots`, named by `weighting`), the error is
    shaped by what it costs the model: the basis and steps are fitted in the space where an
    error e costs |e S|^2, S the KV head's root."""
    from scipy.linalg import block_diag

    layers, _, heads, dim = caches[0].shape[1:]
    if roots is not None and np.shape(roots) != (layers, 2, heads, dim, dim):
        raise ValueError(f"roots must be ({layers}, 2, {heads}, {dim}, {dim})")
    if settings.layer_steps is not None and (np.shape(settings.layer_steps) != (layers, 2)
                                             or not (np.asarray(settings.layer_steps) > 0).all()):
        raise ValueError(f"layer_steps must be ({layers}, 2) positive multipliers")
    if not 0 <= settings.deadzone < 0.5:
        raise ValueError("the deadzone is in steps, in [0, 0.5)")
    inv_freq = inv_frequencies(settings.rope_theta or 10000.0, dim)
    positions = np.concatenate([settings.position_offset + np.arange(len(x)) for x in caches])
    keys, values = split(np.concatenate(caches), positions, inv_freq)
    arrays: dict = {"inv_freq": inv_freq, "step": np.zeros((layers, 2), np.float32)}
    symbols = np.zeros((len(keys), layers, 2, keys.shape[2]), np.int32)
    rk, rv = np.empty_like(keys), np.empty_like(values)
    steps = (settings.key_step, settings.value_step)
    work = Widened(arrays)  # the stored (float16) tables, as every reader will compute with them
    ones = np.ones(len(keys), np.float32)
    for layer in range(layers):
        for kv, (x, recon) in enumerate(((keys, rk), (values, rv))):
            scale = 1.0 if settings.layer_steps is None else float(settings.layer_steps[layer][kv])
            root = None if roots is None else block_diag(*roots[layer, kv])
            _fit_layer(arrays, layer, kv, x[:, layer], context(rk, rv, layer, kv), steps[kv] * scale, settings, root)
            pred = predict(work, layer, kv, rk, rv)
            z = ((x[:, layer] - pred - work[f"const.{layer}.{'kv'[kv]}"]) @ work[f"basis.{layer}.{'kv'[kv]}"]) \
                / arrays["step"][layer, kv]
            q = np.clip(quantise(z, settings.deadzone), -MAX_RADIUS, MAX_RADIUS).astype(np.int32)
            symbols[:, layer, kv] = q
            recon[:, layer] = rebuild(work, layer, kv, q, ones, pred)
    arrays.update(_classes(symbols))
    bits = _token_bits(arrays, symbols)
    info = {"format": FORMAT if roots is None else WEIGHTED_FORMAT, "weighting": weighting,
            "geometry": {"layers": int(layers), "kv_heads": int(heads), "head_dim": int(dim)},
            "group": settings.group, "group_words": _group_words(bits, settings),
            # on its own passages (in-sample); other passages cost more (docs/results.md, "Store size")
            "bits_per_element": round(float(bits.mean() / symbols[0].size), 4),
            "key_step": settings.key_step, "value_step": settings.value_step, "rope_theta": settings.rope_theta,
            "layer_steps": None if settings.layer_steps is None else [[round(float(m), 4) for m in row]
                                                                      for row in settings.layer_steps],
            "position_offset": settings.position_offset, "predict": settings.predict,
            **({"deadzone": settings.deadzone} if settings.deadzone else {}),
            "transform": settings.transform, "tokens": int(len(keys)), "passages": len(caches),
            "source": source}
    return Calibration(arrays, info)


def fit_to_ratio(caches: list[np.ndarray], settings: FitOptions, ratio: float, source: str = "",
                 tries: int = 7, roots: np.ndarray | None = None, weighting: str | None = None) -> Calibration:
    """`fit` with both steps scaled by one factor (their proportion kept), found by bisection in
    log space on up to 10,000 of the tokens, so that the calibration codes its own passages at
    about `ratio` of raw bf16 (16 bits per element x ratio). Passages unlike them cost more."""
    from dataclasses import replace

    sample, n = [], 0
    for x in caches:  # the first passages, as many as fill 10,000 tokens
        if n >= 10_000:
            break
        sample.append(x)
        n += len(x)
    lo, hi = 1 / 16, 16.0  # step multipliers: finer than 1/16 or coarser than 16x is no rate anyone wants
    for _ in range(tries):
        mid = float(np.sqrt(lo * hi))
        scaled = replace(settings, key_step=settings.key_step * mid, value_step=settings.value_step * mid)
        if fit(sample, scaled, roots=roots).info["bits_per_element"] > 16 * ratio:
            lo = mid
        else:
            hi = mid
    return fit(caches, replace(settings, key_step=round(settings.key_step * hi, 4),
                               value_step=round(settings.value_step * hi, 4)), source, roots, weighting)


def _fit_layer(arrays: dict, layer: int, kv: int, x: np.ndarray, ctx: np.ndarray | None, step: float,
               settings: FitOptions, root: np.ndarray | None = None) -> None:
    name = "kv"[kv]
    x64 = x.astype(np.float64)
    residual = x64
    if ctx is not None and settings.predict:
        design = np.hstack([ctx.astype(np.float64), np.ones((len(ctx), 1))])
        gram = design.T @ design
        gram[np.diag_indices(len(gram) - 1)] += RIDGE * np.trace(gram) / len(gram)
        m = np.linalg.solve(gram, design.T @ x64)
        arrays[f"map.{layer}.{name}"] = m.astype(np.float16)  # the residual is taken from the stored map
        residual = x64 - design @ m.astype(np.float16).astype(np.float64)
    mean = residual.mean(0)

    def weighted(a: np.ndarray) -> np.ndarray:  # into the space where the error's cost is its norm
        return a if root is None else a @ root

    basis = np.eye(x.shape[1])
    if settings.transform:
        # the eigenvectors of the (weighted) residuals' scatter: a complete orthonormal basis even
        # from fewer tokens than channels (directions unseen in calibration are never-coded components)
        centred = weighted(residual - mean)
        energy, vectors = np.linalg.eigh(centred.T @ centred)
        basis = vectors[:, np.argsort(energy)[::-1]]
    arrays[f"mean.{layer}.{name}"] = mean.astype(np.float16)
    arrays[f"basis.{layer}.{name}"] = (basis if root is None else root @ basis).astype(np.float16)  # analysis
    if root is not None:
        arrays[f"synthesis.{layer}.{name}"] = (basis.T @ np.linalg.inv(root)).astype(np.float16)
    # in units of the layer's own (weighted) spread, not its residual's: one step means one error level
    arrays["step"][layer, kv] = np.float32(step * np.sqrt((weighted(x64 - x64.mean(0)) ** 2).mean()))



def _token_bits(arrays: dict, symbols: np.ndarray) -> np.ndarray:
    """Each calibration token's ideal bits under the fitted models `(tokens,)`."""
    probs = Calibration(arrays, {}).class_probabilities()
    flat = symbols.reshape(len(symbols), -1)
    bits = np.zeros(len(flat))
    for c, p in enumerate(probs):
        members = np.flatnonzero(arrays["klass"].reshape(-1) == c)
        if len(members):
            bits += -np.log2(p[flat[:, members] + arrays["radius"][c]]).sum(1)
    return bits


def _group_words(bits: np.ndarray, settings: FitOptions) -> int:
    """uint32 words a code row holds: the headroom times the calibration's costliest group, by the
    models' ideal bits (ANS spends within a word or two of them)."""
    groups = np.add.reduceat(bits, np.arange(0, len(bits), settings.group))
    return int(np.ceil(settings.headroom * groups.max() / 32)) + 8


def _classes(symbols: np.ndarray) -> dict:
    """Components by the spread of their calibration symbols: never nonzero -> not coded (-1);
    otherwise one class per 1/4 octave of RMS, each with the pooled histogram of its components."""
    flat = symbols.reshape(len(symbols), -1)
    rms = np.sqrt((flat.astype(np.float64) ** 2).mean(0))
    live = np.abs(flat).max(0) > 0
    lo, hi = SPREAD_RANGE
    bins = np.clip(np.floor((np.log2(np.maximum(rms, 2.0 ** lo)) - lo) * CLASSES_PER_OCTAVE), 0,
                   (hi - lo) * CLASSES_PER_OCTAVE).astype(np.int64)
    used = np.unique(bins[live])
    klass = np.full(flat.shape[1], -1, np.int16)
    klass[live] = np.searchsorted(used, bins[live])
    peaks = [int(np.abs(flat[:, klass == c]).max()) for c in range(len(used))]
    radius = np.array([min(MAX_RADIUS, max(2, 2 * p)) for p in peaks], np.int32)
    width = 2 * int(radius.max(initial=2)) + 1
    counts = np.zeros((len(used), width), np.int64)
    centre = width // 2
    for c in range(len(used)):
        values, n = np.unique(flat[:, klass == c], return_counts=True)
        counts[c, centre + values] = n
    return {"klass": klass.reshape(symbols.shape[1:]), "counts": counts, "radius": radius}
