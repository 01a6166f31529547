"""Which calibration a new transform-codec (`tc`) store gets, and fitting one from a store.

A `tc` store keeps its calibration once, in the store (`codec/`), and every append, reader,
compaction and Ray worker uses that copy. A new store takes the file the user names
(`encode --calibration FILE`, fitted with `cachegraft store calibrate`), or else the one shipped
with the preset's built-in fuser (fitted on a corpus outside the QA sets; `fuser/builtin/*/TRAINING.md`).
Without either, `--codec tc` is refused before any model loads. A new store is `tc` when nothing
is named and the fuser ships a calibration, int8 otherwise (`default_codec`).
"""

from __future__ import annotations

from pathlib import Path

from cachegraft_cli.errors import UsageError
from cachegraft_cli.progress import loading

SHIPPED = "codec-calibration.safetensors"  # beside a built-in fuser's weights


def default_codec(fuser_spec: str | None) -> tuple[str, str | None]:
    """A new store's codec when none is named, and a note saying why: the transform codec where
    the fuser ships a calibration (0.124x raw bf16 KV at int4's KL; graft's EM/F1 from it at
    k = 1, 3, 5 within noise of int8's; docs/results.md, "Store size"), int8 elsewhere
    (`store.codecs.DEFAULT_CODEC`: a calibration needs the receiver's own caches)."""
    from cachegraft_cli.store.codecs import DEFAULT_CODEC

    if shipped_file(fuser_spec) is None:
        return DEFAULT_CODEC, None
    return "tc", ("the store is tc, the transform codec (about 0.12x raw bf16 KV), with the calibration this fuser "
                  "ships. --codec int8 stores 0.47x and loads a little faster (docs/results.md, \"Store size\").")


def store_codec(named: str | None, existing: str | None, fuser_spec: str | None) -> tuple[str, str | None]:
    """The codec an encode writes with: the one named, else the existing store's, else a new
    store's `default_codec` (with its note; None for the other two)."""
    if named or existing:
        return str(named or existing), None
    return default_codec(fuser_spec)


def shipped_file(fuser_spec: str | None) -> Path | None:
    """The calibration shipped with a built-in fuser, if it has one."""
    if not fuser_spec or not fuser_spec.startswith("builtin:"):
        return None
    from cachegraft_cli.fuser import resolve_fuser_dir

    path = resolve_fuser_dir(fuser_spec) / SHIPPED
    return path if path.is_file() else None


def load_file(path: str | Path):
    """A calibration file the user named, read and parsed (a bad one is a usage error)."""
    from cachegraft_cli.errors import CacheGraftError
    from cachegraft_cli.store.transform import Calibration

    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"calibration file {str(p)!r} does not exist.",
                         "Fit one with `cachegraft store calibrate STORE --out FILE`.")
    try:
        return Calibration.from_bytes(p.read_bytes())
    except CacheGraftError as exc:
        raise UsageError(f"{p} is not a transform-codec calibration: {exc.message}",
                         "Fit one with `cachegraft store calibrate STORE --out FILE`.") from None


def codec_params(codec: str, calibration: str | None, fuser_spec: str | None, exists: bool = False) -> dict | None:
    """The codec parameters of a new store: the transform codec's calibration, or None (also for
    an existing store, which keeps its own: naming another one is refused)."""
    if exists:
        if calibration:
            raise UsageError("--calibration is for a new store; this store keeps the calibration it was made with.",
                             "Drop --calibration, or encode into a new --store.")
        return None
    if codec != "tc":
        if calibration:
            raise UsageError("--calibration is for the transform codec only.", "Add --codec tc, or drop --calibration.")
        return None
    path = calibration or shipped_file(fuser_spec)
    if path is None:
        raise UsageError(
            "--codec tc needs a calibration, and the fuser ships none.",
            "Encode a few hundred passages with --codec int8 (or bf16), fit one with `cachegraft store calibrate "
            "STORE --out cal.safetensors`, then encode with --codec tc --calibration cal.safetensors.")
    return {"calibration": load_file(path)}


WEIGHTING = "receiver"  # the error weighted by the receiver's queries and output projections


def fit_from_store(url: str, settings, max_tokens: int | None = None, ratio: float | None = None,
                   weighted: bool = False, layer_steps: bool = False):
    """A calibration fitted on a store's fused caches, its passages in commit order up to
    `max_tokens` (`settings`: `store.transform.FitOptions`; RoPE theta and the prefix length
    are taken from the store's receiver and template when not set). With `ratio`, both steps
    are scaled (their proportion kept) until the calibration codes its own passages at that
    share of raw bf16 (`store.transform.fit_to_ratio`). `weighted`: the error shaped by what it
    costs the receiver (`lm.errorcost`; loads the store's receiver). `layer_steps`: the per-layer
    step multipliers of the store's fuser's shipped calibration, where it records some and
    `settings` names none."""
    from dataclasses import replace

    from cachegraft_cli.store import CacheStore, transform as tf

    store = CacheStore.open(url)
    g = store.geometry
    if max_tokens is None:  # the fit holds about four float32 copies of what it reads
        max_tokens = int(min(50_000, 1.5e9 / (4 * 2 * g["layers"] * g["kv_heads"] * g["head_dim"])))
    picked, tokens = [], 0
    for row in store.rows():
        if tokens >= max_tokens:
            break
        picked.append(row.id)
        tokens += row.tokens
    if tokens < 1000:
        raise UsageError(f"store {url} holds {tokens} tokens; a calibration needs at least 1,000 (a few "
                         "thousand fit well).", "Encode more passages first, or use a shipped calibration.")
    roots = receiver_roots(store, picked) if weighted else None  # the model loads (or fails) before the reading
    with loading(f"reading {tokens:,} tokens of caches"):
        caches = store.read(picked)
    settings = replace(settings, position_offset=len(store.prefix_token_ids),
                       rope_theta=settings.rope_theta or rope_theta_of(store.identity))
    if layer_steps and settings.layer_steps is None:
        found = shipped_layer_steps(store.identity)
        settings = replace(settings, layer_steps=None if found is None else tuple(map(tuple, found)))
    source = f"{len(picked)} passages of {url}"
    weighting = WEIGHTING if weighted else None
    with loading(f"fitting the calibration on {tokens:,} tokens"):
        if ratio is not None:
            return tf.fit_to_ratio(caches, settings, ratio, source, roots=roots, weighting=weighting), tokens
        return tf.fit(caches, settings, source=source, roots=roots, weighting=weighting), tokens


def shipped_layer_steps(identity: dict) -> list | None:
    """The per-layer step multipliers recorded in the calibration shipped with a store's fuser
    (measured for that receiver: `benchmarks/layer_sensitivity.py`), when its geometry is the store's."""
    path = shipped_file((identity.get("fuser") or {}).get("name"))
    if path is None:
        return None
    info = load_file(path).info
    return info.get("layer_steps") if info["geometry"] == identity.get("geometry") else None


def receiver_roots(store, ids: list[str], max_tokens: int = 20_000):
    """The error forms of the store's receiver (`lm.errorcost.error_roots`), its queries taken on
    the passages `ids` read as encode read them (template prefix, then the passage block)."""
    from cachegraft_cli.lm.errorcost import error_roots
    from cachegraft_cli.lm.models import load_causal_lm
    from cachegraft_cli.lm.template import PromptTemplate

    lm = load_causal_lm((store.identity.get("receiver") or {}).get("name", ""))
    template = PromptTemplate.for_tokenizer(lm.tokenizer)
    prefix = list(store.prefix_token_ids)
    wanted = set(ids)
    token_lists = [prefix + template.passage_ids(row.title, row.read_text) for row in store.rows() if row.id in wanted]
    with loading(f"measuring the receiver's queries on up to {max_tokens:,} tokens"):
        return error_roots(lm.model, token_lists, max_tokens)


def rope_theta_of(identity: dict) -> float:
    """The receiver's RoPE base, from its config.json (a pulled model, a local directory, or the
    hub cache, offline); 10,000 when none has it: un-rotating at other angles only costs bits,
    never exactness (the calibration records the angles it was fitted with)."""
    import json

    from cachegraft_cli.errors import CacheGraftError
    from cachegraft_cli.lm.models import resolve_source

    name = (identity.get("receiver") or {}).get("name", "")
    try:
        source, gguf, kind = resolve_source(name)
    except CacheGraftError:
        return 10000.0
    path = Path(source) / "config.json"
    if kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json")
        path = Path(cached) if isinstance(cached, str) else path
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return 10000.0
    config = config.get("text_config", config)  # multimodal configs keep the language model's inside
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    return float(theta or 10000.0)
