"""Fuser checkpoint IO.

Two layouts:
- *published* (C2C's, `nics-efc/C2C_Fuser`): `config.json`, `final/projector_{i}.pt`
  (a plain state dict), `final/projector_{i}.json`, `final/projector_config.json`.
- *own*: `fuser.json` (spec + projector args) and `fuser.safetensors` (all
  projectors, keys prefixed `projectors.{i}.`).
Both load strictly: a missing or unexpected key, or a shape mismatch, is an
error naming the file and key. Pickles are read with `weights_only=True`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cachegraft_cli.errors import CheckpointError
from cachegraft_cli.fuser.fuser import Fuser, FuserSpec
from cachegraft_cli.fuser.layermap import from_published, to_published
from cachegraft_cli.fuser.projector import ProjectorArgs

OWN_CONFIG = "fuser.json"
OWN_WEIGHTS = "fuser.safetensors"
OWN_FORMAT = "cachegraft-fuser/1"
SHARER_INPUT_KEY = "cachegraft_sharer_input"


def detect_layout(path: Path) -> str:
    if (path / OWN_CONFIG).is_file():
        return "own"
    if (path / "final" / "projector_config.json").is_file():
        return "published"
    raise CheckpointError(
        f"{path} is not a fuser checkpoint: no {OWN_CONFIG} and no final/projector_config.json.",
        "Point --fuser at a directory written by `cachegraft train-fuser` or a published C2C fuser folder.",
    )


def load_checkpoint(path: str | Path) -> Fuser:
    path = Path(path)
    if detect_layout(path) == "own":
        return load_own(path)
    return load_published(path)


# ---- published layout -------------------------------------------------------


def load_published(path: Path) -> Fuser:
    final = path / "final"
    recipe = _read_json(path / "config.json")
    layer_map = from_published(_read_json(final / "projector_config.json"))
    count = 1 + max(p for pairs in layer_map.values() for _, p in pairs)
    args = [_projector_args(final / f"projector_{i}.json") for i in range(count)]
    fuser = Fuser(_spec_from_recipe(recipe, layer_map), args)
    for i, projector in enumerate(fuser.projectors):
        file = final / f"projector_{i}.pt"
        _load_strict(projector, _torch_load(file), file)
    return fuser.eval()


def save_published(fuser: Fuser, path: str | Path) -> None:
    path = Path(path)
    (path / "final").mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", _recipe(fuser))
    _write_json(path / "final" / "projector_config.json", to_published(fuser.spec.layer_map))
    for i, projector in enumerate(fuser.projectors):
        torch.save(dict(projector.state_dict()), path / "final" / f"projector_{i}.pt")
        init = {**projector.args.as_dict(), "dtype": {"__type__": "torch.dtype", "value": projector.args.dtype}}
        _write_json(path / "final" / f"projector_{i}.json", {"class": "C2CProjector", "init_args": init})


def _spec_from_recipe(recipe: dict, layer_map) -> FuserSpec:
    model = recipe.get("model", {})
    if "base_model" not in model or "teacher_model" not in model:
        raise CheckpointError("config.json lacks model.base_model / model.teacher_model.", "Is this a C2C fuser "
                                                                                           "folder?")
    return FuserSpec(
        receiver=model["base_model"],
        sharer=model["teacher_model"],
        layer_map=layer_map,
        alignment=bool(model.get("is_do_alignment", False)),
        alignment_strategy=model.get("alignment_strategy", "first"),
        sharer_input=model.get(SHARER_INPUT_KEY, "model"),
        extra={k: v for k, v in recipe.items() if k != "model"} | {"model_extra": _model_extra(model)},
    )


def _model_extra(model: dict) -> dict:
    skip = ("base_model", "teacher_model", "is_do_alignment", "alignment_strategy", SHARER_INPUT_KEY)
    return {k: v for k, v in model.items() if k not in skip}


def _recipe(fuser: Fuser) -> dict:
    s = fuser.spec
    extra = dict(s.extra)
    model_extra = extra.pop("model_extra", {})
    params = fuser.projectors[0].args.as_dict()
    params.pop("dtype")
    model_extra.setdefault("projector", {"type": "C2CProjector", "params": params})
    model_extra.setdefault("mapping", "last_aligned")
    model = {
        "base_model": s.receiver,
        "teacher_model": s.sharer,
        "is_do_alignment": s.alignment,
        "alignment_strategy": s.alignment_strategy,
        **model_extra,
    }
    if s.sharer_input != "model":  # cachegraft-specific: C2C loaders ignore unknown model keys
        model[SHARER_INPUT_KEY] = s.sharer_input
    return {"model": model, **extra}


def _projector_args(file: Path) -> ProjectorArgs:
    meta = _read_json(file)
    if meta.get("class") != "C2CProjector":
        raise CheckpointError(f"{file}: projector class {meta.get('class')!r} is not supported.", "Only C2CProjector "
                                                                                                  "fusers load.")
    init = dict(meta.get("init_args", {}))
    dtype = init.get("dtype", "float32")
    init["dtype"] = dtype["value"] if isinstance(dtype, dict) else str(dtype).removeprefix("torch.")
    try:
        return ProjectorArgs(**init)
    except TypeError as exc:
        raise CheckpointError(
            f"{file}: bad init_args ({exc}).", "The file does not match the C2CProjector layout."
        ) from None


def _torch_load(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing.", "The checkpoint is incomplete: download or copy it again.")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError... for unsafe or broken files
        raise CheckpointError(
            f"{file} is not a plain tensor state dict ({type(exc).__name__}); refusing to unpickle it.",
            "Only load fusers from sources you trust; re-save the weights as a plain state dict.",
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} does not hold a dict of tensors.", "Re-save it as a plain state dict.")
    return state


def _load_strict(module: torch.nn.Module, state: dict, file: Path) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{file}: missing key {missing[0]!r} ({len(missing)} missing).", _LAYOUT_HINT)
    if extra:
        raise CheckpointError(f"{file}: unexpected key {extra[0]!r} ({len(extra)} unexpected).", _LAYOUT_HINT)
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{file}: key {key!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[key].shape)}.",
                _LAYOUT_HINT,
            )
    module.load_state_dict(state, strict=True)


_LAYOUT_HINT = (
    "The weights do not match the projector described by its JSON; the checkpoint is damaged or of another kind."
)


# ---- own layout -------------------------------------------------------------


def save_own(fuser: Fuser, path: str | Path, extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in fuser.state_dict().items()}
    save_file(state, str(path / OWN_WEIGHTS))
    meta = {
        "format": OWN_FORMAT,
        "receiver": fuser.spec.receiver,
        "sharer": fuser.spec.sharer,
        "alignment": fuser.spec.alignment,
        "alignment_strategy": fuser.spec.alignment_strategy,
        "layer_map": {str(t): [list(x) for x in pairs] for t, pairs in sorted(fuser.spec.layer_map.items())},
        "projectors": [p.args.as_dict() for p in fuser.projectors],
        "recipe": fuser.spec.extra,
        "sharer_input": fuser.spec.sharer_input,
        **(extra or {}),
    }
    _write_json(path / OWN_CONFIG, meta)


def load_own(path: Path) -> Fuser:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta = _read_json(path / OWN_CONFIG)
    if meta.get("format") != OWN_FORMAT:
        raise CheckpointError(f"{path / OWN_CONFIG}: unknown format {meta.get('format')!r}.", f"Expected {OWN_FORMAT}.")
    layer_map = {int(t): [(int(s), int(p)) for s, p in pairs] for t, pairs in meta["layer_map"].items()}
    spec = FuserSpec(meta["receiver"], meta["sharer"], layer_map, meta["alignment"], meta["alignment_strategy"],
                     meta.get("recipe", {}), meta.get("sharer_input", "model"))
    fuser = Fuser(spec, [ProjectorArgs(**a) for a in meta["projectors"]])
    file = path / OWN_WEIGHTS
    try:
        state = load_file(str(file))
    except (SafetensorError, FileNotFoundError, OSError) as exc:
        raise CheckpointError(f"{file} cannot be read ({exc}).", "The checkpoint is incomplete or damaged.") from None
    _load_strict(fuser, state, file)
    return fuser.eval()


def convert(src: str | Path, dst: str | Path, layout: str) -> Path:
    """Convert a checkpoint between layouts ("own" or "published")."""
    fuser = load_checkpoint(src)
    (save_own if layout == "own" else save_published)(fuser, dst)
    return Path(dst)


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{file} is missing.", "The checkpoint is incomplete: download or copy it again."
        ) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}).", "The checkpoint is damaged.") from None


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2))
