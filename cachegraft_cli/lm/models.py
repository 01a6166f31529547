"""Load causal LMs and their tokenizers from a hub id, a local directory, a
`.gguf` file, or a model pulled with `cachegraft models pull`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from cachegraft_cli.errors import HubUnreachableError, ModelLoadError, UsageError


@dataclass
class LoadedModel:
    spec: str
    model: Any
    tokenizer: Any
    identity: dict = field(default_factory=dict)

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    @property
    def geometry(self):
        from cachegraft_cli.lm.kvcache import model_geometry

        return model_geometry(self.model.config)


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are fast on CPUs with AVX512-BF16 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_device(device: str | None = None) -> str:
    if device:
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
          "float32": "float32", "fp32": "float32", "float": "float32"}


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}.", "Use bfloat16, float16 or float32.")


def check_device(device: str | None) -> None:
    """Refuse a device this torch cannot use, before anything loads (`cuda:7` on a CPU-only build)."""
    if not device:
        return
    import torch

    try:
        where = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {device!r}.", "Use cpu, cuda, cuda:N or mps.") from None
    if where.type == "cpu":
        return
    if where.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if not torch.backends.cuda.is_built() else "no CUDA GPU is visible"
            raise UsageError(f"device {device!r}: {why}.", "Use --device cpu, or leave --device out to pick one.")
        count = torch.cuda.device_count()
        if where.index is not None and where.index >= count:
            raise UsageError(f"device {device!r}: there are {count} CUDA devices (cuda:0 to cuda:{count - 1}).",
                             "Pick one of those, or leave --device out.")
        return
    if where.type == "mps" and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return
    raise UsageError(f"device {device!r} is not available here.", "Use cpu, cuda, cuda:N or mps.")


def pick_dtype(device: str, dtype: str | None = None):
    import torch

    if dtype:
        try:
            return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype) or getattr(
                torch, dtype
            )
        except AttributeError:
            raise ModelLoadError(f"Unknown dtype {dtype!r}.", "Use bfloat16, float16 or float32.") from None
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device == "cpu":
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    return torch.float16


def resolve_source(spec: str) -> tuple[str, str | None, str]:
    """(path or hub id, gguf file name or None, kind) for a model spec."""
    if spec.startswith("pulled:"):
        from cachegraft_cli.lm.pull import resolve_pulled

        return str(resolve_pulled(spec)), None, "pulled"
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist.", "Check the path.")
        return str(path.parent), path.name, "gguf"
    if path.is_dir():
        check_weight_format(path)
        return str(path), None, "local"
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return spec, None, "hub"
    raise ModelLoadError(f"Model {spec!r} is not a local directory, a .gguf file or a hub id.", _SPEC_HINT)


_SPEC_HINT = "Give a hub id (org/name), a local model directory, a .gguf file, or pulled:<name>."
# Weights that only a pickle loader reads (torch.load can run code from them); transformers
# would fall back to them when a directory has no safetensors.
_PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def check_weight_format(path: Path) -> None:
    """Refuse a model directory whose weights are only pickles, before anything loads: they are
    never unpickled here, and torch's own refusal would suggest `weights_only=False`, which would
    run whatever code the file holds."""
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for pattern in _PICKLE_WEIGHTS for p in path.glob(pattern))
    if pickles:
        raise ModelLoadError(
            f"Model directory {path} holds its weights as a pickle ({', '.join(pickles[:3])}), not safetensors; "
            "cachegraft loads model weights only from safetensors files.",
            "Convert it once, where you trust the file: load it with transformers and call "
            "save_pretrained(DIR, safe_serialization=True), then point at DIR; or use a safetensors copy "
            "of the model (most hub repos ship one).")


def load_causal_lm(
    spec: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    weights: str = "as-loaded",
) -> LoadedModel:
    """Load a model and tokenizer in eval mode on the chosen device and dtype; `weights` int8 or
    int4 converts its linear layers to weight-only int8 / int4 (CPU, see `weights.py`)."""
    from cachegraft_cli.progress import loading

    with loading(f"loading {_short(spec)}" + ("" if weights == "as-loaded" else f" ({weights} weights)")):
        lm = _load_causal_lm(spec, device, dtype, trust_remote_code, revision)
        if weights != "as-loaded":
            from cachegraft_cli.lm.weights import check_weights, quantize_linears

            check_weights(weights, str(lm.device))
            quantize_linears(lm.model, weights)
            lm.identity["weights"] = weights  # the fingerprint stays the loaded model's (same store)
        return lm


def _short(spec: str) -> str:
    """A model spec as a status line shows it: a directory by its last part."""
    return Path(spec).name if "/" in spec and Path(spec).expanduser().exists() else spec


def _load_causal_lm(spec: str, device, dtype, trust_remote_code: bool, revision) -> LoadedModel:
    source, gguf, kind = resolve_source(spec)
    _quiet_transformers()
    device = pick_device(device)
    torch_dtype = pick_dtype(device, dtype)
    kwargs = {"trust_remote_code": trust_remote_code, "revision": revision}
    if gguf:
        kwargs["gguf_file"] = gguf
    tokenizer = _load(lambda: _auto_tokenizer(source, kwargs), spec, kind)
    model = _load(lambda: _auto_model(source, torch_dtype, kwargs), spec, kind)
    model.to(device).eval()
    from cachegraft_cli.lm import gqa
    from cachegraft_cli.lm.onednn import route_linears

    route_linears(model)  # large float32 CPU layers through oneDNN (see onednn.py)
    gqa.install(model)  # one-token GQA attention packed per KV head (see gqa.py)
    return LoadedModel(spec, model, tokenizer, model_identity(spec, source, gguf, kind, model))


def load_tokenizer(spec: str, *, trust_remote_code: bool = False, revision: str | None = None):
    """The tokenizer of a model spec alone (no weights): enough to plan an encode."""
    source, gguf, kind = resolve_source(spec)
    kwargs: dict = {"trust_remote_code": trust_remote_code, "revision": revision}
    if gguf:
        kwargs["gguf_file"] = gguf
    return _load(lambda: _auto_tokenizer(source, kwargs), spec, kind)


def _quiet_transformers() -> None:
    """Weight-loading progress bars would clutter stderr on every command."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def _auto_tokenizer(source: str, kwargs: dict):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source, **kwargs)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _auto_model(source: str, torch_dtype, kwargs: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)


def _load(fn, spec: str, kind: str):
    try:
        return fn()
    except OSError as exc:
        if kind == "hub":
            raise HubUnreachableError(
                f"Could not load {spec!r} from the Hugging Face hub ({str(exc).splitlines()[0]}).",
                "Without hub access, point at a local model directory or .gguf file instead, "
                "or use `cachegraft models pull offline` and --preset offline.",
            ) from None
        raise ModelLoadError(f"Could not load model {spec!r}: {str(exc).splitlines()[0]}", _SPEC_HINT) from None
    except ValueError as exc:
        raise ModelLoadError(f"Could not load model {spec!r}: {str(exc).splitlines()[0]}", _REMOTE_HINT) from None


_REMOTE_HINT = "If the model needs its own code, pass --trust-remote-code (only for repos you trust)."


def model_identity(spec: str, source: str, gguf: str | None, kind: str, model) -> dict:
    """Name plus a fingerprint that is stable across copies of the same weights.

    Hashing gigabytes on every load is too slow, so the fingerprint covers the
    config and the safetensors headers (names, shapes, dtypes, byte offsets)
    plus the hub commit when there is one; a pulled model adds its pinned sha256.
    """
    config = {k: v for k, v in model.config.to_dict().items() if k not in _PATH_KEYS}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    revision = getattr(model.config, "_commit_hash", None)
    for file in _weight_files(source, gguf, kind):
        h.update(_weights_header(file))
    if revision:
        h.update(revision.encode())
    ident = {"name": spec, "fingerprint": h.hexdigest()[:32]}
    if revision:
        ident["revision"] = revision
    return ident


_PATH_KEYS = ("_name_or_path", "name_or_path", "_commit_hash")  # where the copy lives, not what it is


def _weight_files(source: str, gguf: str | None, kind: str) -> list[Path]:
    root = Path(source)
    if kind == "hub" or not root.is_dir():
        return []
    if gguf:
        return [root / gguf]
    return sorted(root.glob("*.safetensors")) + [p for p in [root / "pulled.json"] if p.is_file()]


def _weights_header(file: Path) -> bytes:
    with open(file, "rb") as f:
        if file.suffix == ".safetensors":
            size = int.from_bytes(f.read(8), "little")
            return f.read(min(size, 1 << 24))
        return f.read(1 << 20) + str(file.stat().st_size).encode()


def configured_window(spec: str) -> int | None:
    """The context window a model's config.json declares, read without loading the model
    (None where there is no config to read here: a .gguf file, a hub model not cached locally)."""
    return configured_count(spec, "max_position_embeddings")


def configured_count(spec: str, key: str) -> int | None:
    """A positive whole number the text part of a model's config.json declares (`num_hidden_layers`,
    `max_position_embeddings`), read without loading the model; None where there is none to read."""
    source, gguf, kind = resolve_source(spec)
    if gguf:
        return None
    path: Path | None = Path(source) / "config.json"
    if kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, "config.json")
        path = Path(found) if isinstance(found, str) else None
    try:
        config = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    nested = config.get("text_config")
    text = nested if isinstance(nested, dict) else config  # as `get_text_config` picks it
    value = text.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def context_window(lm: LoadedModel) -> int | None:
    """How many positions the model was built for (None when its config does not say)."""
    config = lm.model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "max_position_embeddings", None)
    return int(window) if window else None
