"""The C2C fuser: projectors, layer map, checkpoints, and where to find them."""

from __future__ import annotations

from pathlib import Path

from cachegraft_cli.errors import CheckpointError, HubUnreachableError

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


def load_fuser(spec: str | None):
    """Resolve a fuser spec to a loaded `Fuser`, or None for `closed`.

    Specs: `closed`, `builtin:<name>`, a local directory, or `REPO:SUBFOLDER`
    / `REPO` on the Hugging Face hub.
    """
    from cachegraft_cli.fuser.checkpoint import load_checkpoint

    if spec in (None, "", "closed", "none"):
        return None
    return load_checkpoint(resolve_fuser_dir(spec))


def place_fuser(fuser, device):
    """Move a fuser to the receiver's device, in float32 on CPUs without fast bf16
    (bf16 is emulated there, and many times slower); elsewhere it keeps its own dtype."""
    import torch

    from cachegraft_cli.lm.models import cpu_has_fast_bf16
    from cachegraft_cli.lm.onednn import route_linears

    slow_bf16 = device.type == "cpu" and not cpu_has_fast_bf16()
    fuser = fuser.to(device=device, dtype=torch.float32 if slow_bf16 else fuser.dtype)
    route_linears(fuser)
    return fuser


def check_fuser_spec(spec: str | None) -> None:
    """What can be checked of a fuser spec without loading it or asking the hub."""
    if spec in (None, "", "closed", "none"):
        return
    if spec.startswith("builtin:"):
        resolve_fuser_dir(spec)
    elif Path(spec).expanduser().exists():
        from cachegraft_cli.fuser.checkpoint import detect_layout

        detect_layout(Path(spec).expanduser())
    elif "/" not in spec:
        raise CheckpointError(f"Fuser {spec!r} is neither a local directory nor a hub repo id.", _FUSER_HINT)


def resolve_fuser_dir(spec: str) -> Path:
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        path = BUILTIN_DIR / name
        # a name, never a path: `builtin:../../x` must not reach outside the shipped fusers
        if not _is_plain_name(name) or path.resolve().parent != BUILTIN_DIR.resolve() or not path.is_dir():
            known = ", ".join(sorted(p.name for p in BUILTIN_DIR.iterdir())) if BUILTIN_DIR.is_dir() else "none"
            raise CheckpointError(f"No built-in fuser named {spec!r}.", f"Built-in fusers: {known}.")
        return path
    local = Path(spec).expanduser()
    if local.exists():
        return local
    if "/" not in spec:
        raise CheckpointError(f"Fuser {spec!r} is neither a local directory nor a hub repo id.", _FUSER_HINT)
    repo, _, subfolder = spec.partition(":")
    return _hub_fuser_dir(repo, subfolder)


_FUSER_HINT = "Give --fuser a local directory, REPO:SUBFOLDER on the hub, builtin:<name>, or closed."


def _is_plain_name(name: str) -> bool:
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name)) and ".." not in name


def _hub_fuser_dir(repo: str, subfolder: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = [f"{subfolder}/*", f"{subfolder}/final/*"] if subfolder else None
    try:
        root = Path(snapshot_download(repo_id=repo, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises many kinds: offline, 404, connection, auth
        raise HubUnreachableError(
            f"Could not get fuser {repo}{':' + subfolder if subfolder else ''} from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}).",
            "Without hub access, download the fuser folder elsewhere and pass --fuser /path/to/folder "
            "(the folder holding config.json and final/).",
        ) from None
    path = root / subfolder if subfolder else root
    if not path.is_dir():
        raise CheckpointError(f"Hub repo {repo} has no folder {subfolder!r}.", "Check the folder name (case matters).")
    return path
