"""The corpus the offline preset's shipped transform-codec calibration is fitted on: English prose
that every Python install carries (the help topics of `pydoc_data.topics`), outside every QA set.

Paragraphs are joined into passages of about `--words` words (the shape `encode` stores), in the
topics' sorted order, so the corpus is the same wherever the same Python runs.

    python benchmarks/calibration_corpus.py [--words 120] > calibration.jsonl
    cachegraft encode calibration.jsonl --store cal-store --preset offline --codec float32
    cachegraft store calibrate cal-store --out codec-calibration.safetensors
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def passages(words: int):
    from pydoc_data.topics import topics

    for name in sorted(topics):
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[name])]
        buf: list[str] = []
        n = 0
        for p in filter(None, paragraphs):
            buf.append(p)
            n += len(p.split())
            if n >= words:
                yield name, " ".join(buf)
                buf, n = [], 0
        if n >= words // 4:
            yield name, " ".join(buf)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=120, help="words per passage (about)")
    args = ap.parse_args(argv)
    for i, (name, text) in enumerate(passages(args.words)):
        sys.stdout.write(json.dumps({"id": f"{name}-{i}", "title": name, "text": text}) + "\n")


if __name__ == "__main__":
    main()
