"""The frozen models' passage caches, computed once (no gradients) and reused.

`CacheBank` holds, per passage key, the receiver's own passage KV and the
sharer's KV of the same tokens, exactly as `PassageFusion` feeds them to the
fuser at encode time (same prefix, template, positions, right-padded batches;
see `PassageFusion.model_kv`). Arrays are stacked per passage as
`(layers, 2, kv_heads, tokens, head_dim)` and kept in memory in the bank's
dtype; with a cache directory they are also written as safetensors files so a
resumed or repeated run (e.g. the adapter control) skips the model passes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

from cachegraft_cli.lm.kvcache import PlainKV


def stack(kv: PlainKV) -> torch.Tensor:
    return torch.stack([torch.stack([k, v]) for k, v in kv])


def bank_identity(receiver, sharer, template, dtype: str, notes: dict | None = None) -> dict:
    """What the bank's caches depend on (`notes`: `notes_identity` of the passages' notes, if any)."""
    return {
        "receiver": receiver.identity,
        "sharer": {**sharer.identity, "dtype": str(sharer.dtype).removeprefix("torch.")}
        if sharer is not None
        else None,
        "template": template.identity(),
        "prefix_token_ids": template.prefix_ids(),
        "dtype": dtype,
        "model_dtype": str(receiver.dtype).removeprefix("torch."),
        **({"notes": notes} if notes else {}),
    }


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class CacheBank:
    def __init__(self, identity: dict, dtype: str = "bfloat16", root: str | Path | None = None):
        self.dtype = getattr(torch, dtype)
        self.own: dict[str, torch.Tensor] = {}
        self.sharer: dict[str, torch.Tensor] = {}
        self.with_sharer = identity["sharer"] is not None
        self.dir: Path | None = None
        self.sharer_dir: Path | None = None
        if root is not None:
            own_id = {k: v for k, v in identity.items() if k != "sharer"}
            self.dir = Path(root) / f"receiver-{_digest(own_id)}"
            self.sharer_dir = self.dir / f"sharer-{_digest(identity['sharer'])}" if self.with_sharer else None
            (self.sharer_dir or self.dir).mkdir(parents=True, exist_ok=True)
            (self.dir / "identity.json").write_text(json.dumps(own_id, indent=1, default=str))

    def has(self, key: str) -> bool:
        return key in self.own and (not self.with_sharer or key in self.sharer)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.own[key], self.sharer.get(key)

    def tokens(self, key: str) -> int:
        return self.own[key].shape[3]

    def missing(self, keys) -> list[str]:
        """Keys neither in memory nor loadable from the cache directory (loads those that are)."""
        return [k for k in keys if not self.has(k) and not self._load(k)]

    def fill(self, engine, ids: dict[str, list[int]], batch_size: int = 8, progress: Callable | None = None) -> int:
        """Load or compute every passage in `ids` (key -> token ids); returns how many were computed."""
        todo = self.missing(ids)
        todo.sort(key=lambda k: len(ids[k]))  # length buckets: little padding per batch
        for start in range(0, len(todo), batch_size):
            keys = todo[start : start + batch_size]
            for key, (own, sharer) in zip(keys, engine.model_kv([ids[k] for k in keys])):
                self._put(key, stack(own), stack(sharer) if sharer is not None else None)
            if progress:
                progress(len(keys), sum(len(ids[k]) for k in keys))
        return len(todo)

    def _put(self, key: str, own: torch.Tensor, sharer: torch.Tensor | None) -> None:
        self.own[key] = own.to(self.dtype).contiguous()
        if sharer is not None and self.with_sharer:
            self.sharer[key] = sharer.to(self.dtype).contiguous()
        if self.dir is not None:
            from safetensors.torch import save_file

            save_file({"kv": self.own[key]}, str(self._file(self.dir, key)))
            if key in self.sharer and self.sharer_dir is not None:  # a sharer cache implies a sharer dir
                save_file({"kv": self.sharer[key]}, str(self._file(self.sharer_dir, key)))

    def _load(self, key: str) -> bool:
        if self.dir is None:
            return False
        from safetensors.torch import load_file

        own_file = self._file(self.dir, key)
        sharer_file = self._file(self.sharer_dir, key) if self.sharer_dir is not None else None
        if not own_file.is_file() or (sharer_file is not None and not sharer_file.is_file()):
            return False
        try:
            self.own[key] = load_file(str(own_file))["kv"].to(self.dtype)
            if sharer_file is not None:
                self.sharer[key] = load_file(str(sharer_file))["kv"].to(self.dtype)
        except Exception:  # noqa: BLE001 - a torn file from an interrupted run: recompute it
            self.own.pop(key, None)
            return False
        return True

    @staticmethod
    def _file(folder: Path, key: str) -> Path:
        return folder / f"{hashlib.sha1(key.encode()).hexdigest()}.safetensors"

    def input_scales(self, keys: list[str], layer_map: dict) -> dict:
        """Per receiver layer, 1/RMS of the receiver and sharer K and V over `keys`
        (the fixed constants that tame the fuser's input scale)."""
        sums: dict[tuple[int, str], list] = {}
        for key in keys:
            own, sharer = self.get(key)
            for t, pairs in layer_map.items():
                s = pairs[0][0]
                for b, name in enumerate(("key", "value")):
                    acc = sums.setdefault((t, name), [0.0, 0.0, 0, 0])
                    x = own[t, b].float()
                    acc[0] += float((x * x).sum())
                    acc[2] += x.numel()
                    if sharer is not None:
                        y = sharer[s, b].float()
                        acc[1] += float((y * y).sum())
                        acc[3] += y.numel()
        out: dict = {}
        for (t, name), (ss_r, ss_s, n_r, n_s) in sums.items():
            rms_r = (ss_r / max(n_r, 1)) ** 0.5
            rms_s = (ss_s / max(n_s, 1)) ** 0.5 if n_s else 0.0
            out.setdefault(t, {})[name] = {
                "receiver": 1.0 / rms_r if rms_r > 0 else 1.0,
                "sharer": 1.0 / rms_s if rms_s > 0 else 1.0,
                "receiver_rms": rms_r,
                "sharer_rms": rms_s,
            }
        return out
