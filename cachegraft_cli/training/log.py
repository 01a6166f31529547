"""Run logging: `train_log.jsonl` (one JSON object per event) and a stderr progress bar."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class RunLog:
    def __init__(self, out: Path, resume: bool):
        self.file = out / "train_log.jsonl"
        if not resume and self.file.exists():
            self.file.unlink()

    def write(self, event: str, **fields) -> None:
        row = {"event": event, "time": round(time.time(), 3), **fields}
        with open(self.file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, default=float) + "\n")

    def truncate_after(self, step: int) -> None:
        """On resume, drop events logged after the checkpoint (they will be redone)."""
        if not self.file.exists():
            return
        keep = []
        for line in self.file.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if row.get("step") is None or row["step"] <= step:
                keep.append(line)
        self.file.write_text("".join(k + "\n" for k in keep), encoding="utf-8")


class Progress:
    """tqdm on stderr with loss and throughput; silent when disabled."""

    def __init__(self, total: int | None, initial: int, enabled: bool, desc: str = "train"):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
        self.t0, self.items, self.tokens = time.perf_counter(), 0, 0

    def step(self, loss: float, items: int, tokens: int, gates_open: int, gates: int) -> None:
        self.items += items
        self.tokens += tokens
        if self.bar is None:
            return
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(
            f"loss {loss:.3f} | {self.items / dt:.2f} items/s {self.tokens / dt:.1f} scored tok/s | gates "
            f"{gates_open}/{gates}",
            refresh=False,
        )
        self.bar.update(1)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
