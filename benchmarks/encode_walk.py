"""How `cg.encode` walks the package, and what an append to an S3 store reads.

Two figures, both counted with `sys.setprofile` while one `cg.encode` call runs (nothing else
is traced: the tiny models are built, and the first S3 encode done, before tracing starts):

(a) the walk, over a tiny-model encode into a new local store (the test fixtures' random
    receiver, no sharer, float32 codec, 4 passages, a commit every 2). Every Python call whose
    code lies in `cachegraft_cli/` is a step into that file's module; calls into other code
    (torch, zarr, the standard library) are skipped, and a package function called from such
    code counts from the package frame that called it. A step is an *entry* into module M when
    the calling package frame is in another module. An entry is a *climb back up* when M is on
    the package call stack already (a module below calls back into one above it), and a *return*
    when M was entered earlier in the run but is not on the stack now. Printed: distinct
    modules, entries, climbs back up, returns, and entries into `store/target.py`.

(b) an append of 4 passages (a commit every passage: 4 commit windows) to an S3 store made of
    4 passages, served by moto's S3 server on localhost (as `tests/conftest.py` starts it):
    calls of `Location.list_names` (listings), `segments.load_manifest` (manifest reads) and
    `recover.recover`.

    PYTHONPATH=. python benchmarks/encode_walk.py [--skip-s3]

Run it under another checkout (PYTHONPATH=OTHER) for before/after figures; it speaks both the
`receiver=` and the `models=` forms of `cg.encode`. Needs the `test` extra (moto, s3fs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import inspect
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny.py: the suite's random models

PASSAGES = [{"id": f"p{i}", "title": f"Town {i}",
             "text": f"Harbor town {i} was founded in 18{20 + i} by fishermen who built a lighthouse."}
            for i in range(8)]


def encode(cg, passages, store, receiver: str, commit_every: int):
    """`cg.encode` in whichever form this checkout takes."""
    options = cg.EncodeOptions(codec="float32", commit_every=commit_every)
    if "models" in inspect.signature(cg.encode).parameters:
        return cg.encode(passages, store, models=cg.Models(receiver=receiver, dtype="float32", device="cpu"),
                         options=options)
    return cg.encode(passages, store, receiver=receiver, dtype="float32", device="cpu", options=options)


class Walk:
    """The profile hook of (a) and (b): package modules entered, and calls of named functions."""

    def __init__(self, package: Path):
        self.package = str(package) + os.sep
        self.stack: list[str | None] = []  # the package module of each frame on the stack (None: other code)
        self.seen: set[str] = set()
        self.entries: Counter[str] = Counter()
        self.climbs = self.returns = 0
        self.calls: Counter[str] = Counter()

    def module(self, frame) -> str | None:
        name = frame.f_code.co_filename
        return name[len(self.package):] if name.startswith(self.package) else None

    def __call__(self, frame, event, arg):
        if event == "call":
            mod = self.module(frame)
            if mod is not None:
                self.calls[f"{mod}:{frame.f_code.co_name}"] += 1
                caller = next((m for m in reversed(self.stack) if m is not None), None)
                if mod != caller:
                    self.entries[mod] += 1
                    if mod in self.stack:
                        self.climbs += 1
                    elif mod in self.seen:
                        self.returns += 1
                    self.seen.add(mod)
            self.stack.append(mod)
        elif event == "return" and self.stack:
            self.stack.pop()

    def run(self, fn):
        sys.setprofile(self)
        try:
            return fn()
        finally:
            sys.setprofile(None)

    def figures(self) -> dict:
        return {"modules": len(self.seen), "entries": sum(self.entries.values()), "climbs_back_up": self.climbs,
                "returns_to_left_module": self.returns, "target_entries": self.entries["store/target.py"]}


def walk(cg, package: Path, receiver: str, tmp: Path) -> dict:
    w = Walk(package)
    w.run(lambda: encode(cg, PASSAGES[:4], str(tmp / "walk-store"), receiver, 2))
    return w.figures()


def s3_append(cg, package: Path, receiver: str) -> dict:
    import logging

    import fsspec
    import fsspec.config
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3": json.dumps({"endpoint_url": endpoint})})
        fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
        url = "s3://bench/store"
        encode(cg, PASSAGES[:4], url, receiver, 2)  # the store appended to (not counted)
        w = Walk(package)
        summary = w.run(lambda: encode(cg, PASSAGES, url, receiver, 1))
        return {"added": summary.added, "segments": len(summary.segments),
                "listings": w.calls["store/location.py:list_names"],
                "manifest_reads": w.calls["store/segments.py:load_manifest"],
                "recover_calls": w.calls["store/recover.py:recover"]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-s3", action="store_true", help="only (a), the walk")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from tiny import build_all

    import cachegraft_cli as cg

    package = Path(cg.__file__).resolve().parent
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        receiver = str(build_all(tmp / "models")["receiver"])
        figures = {"walk": walk(cg, package, receiver, tmp)}
        if not args.skip_s3:
            figures["s3_append"] = s3_append(cg, package, receiver)
    print(f"{'figure':30} value")
    for part, values in figures.items():
        for key, value in values.items():
            print(f"{part + '.' + key:30} {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
