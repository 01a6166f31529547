"""Training data: SQuAD-format QA files, or plain text (JSONL / .txt / SQuAD contexts).

Everything is keyed by passage so the validation split is held out by passage
(a question never shares its passage with a training question).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from cachegraft_cli.errors import TrainingError

# Held-out evaluation sets: training on them would contaminate every reported number.
EVAL_SET_PATTERNS = (r"squad_v1\.1_dev", r"dev-v1\.1", r"squad.*dev")


@dataclass(frozen=True)
class TrainingPassage:
    """A passage of the training data, keyed so a file's passages never collide with another's
    (`corpus.Passage` is what `encode` reads: an id, metadata, where it came from)."""

    key: str  # unique across files: "<file stem>:<sha1 of title+text>"
    title: str
    text: str


@dataclass(frozen=True)
class QAPair:
    passage: str  # TrainingPassage.key
    question: str
    answer: str
    id: str = ""


@dataclass
class Dataset:
    passages: dict[str, TrainingPassage]
    questions: list[QAPair]

    def subset(self, keys: set[str]) -> "Dataset":
        return Dataset({k: p for k, p in self.passages.items() if k in keys},
                       [q for q in self.questions if q.passage in keys])


def check_not_eval_set(path: str, allow: bool) -> None:
    name = Path(path).name.lower()
    if not allow and any(re.search(p, name) for p in EVAL_SET_PATTERNS):
        raise TrainingError(
            f"{path} looks like the held-out SQuAD dev set, which is the evaluation set.",
            "Train on other data (e.g. squadshifts_*.json); pass --allow-eval-sets only if you really mean it.",
        )


def read_files(paths: list[str], allow_eval_sets: bool = False) -> Dataset:
    passages: dict[str, TrainingPassage] = {}
    questions: list[QAPair] = []
    for path in paths:
        check_not_eval_set(path, allow_eval_sets)
        p, q = read_file(path)
        passages.update(p)
        questions += q
    if not passages:
        raise TrainingError(f"No passages found in {', '.join(paths)}.", "Check the files' format and fields.")
    return Dataset(passages, questions)


def read_file(path: str) -> tuple[dict[str, TrainingPassage], list[QAPair]]:
    file = Path(path)
    if not file.is_file():
        raise TrainingError(f"Training data file {path} does not exist.", "Check the path given to --data.")
    if file.suffix == ".json":
        return _read_squad(file)
    if file.suffix == ".jsonl":
        return _keyed(file, _read_jsonl(file)), []
    return _keyed(file, [("", t) for t in re.split(r"\n\s*\n", file.read_text(encoding="utf-8")) if t.strip()]), []


def _key(file: Path, title: str, text: str) -> str:
    return f"{file.stem}:{hashlib.sha1((title + chr(0) + text).encode()).hexdigest()[:16]}"


def _keyed(file: Path, rows: list[tuple[str, str]]) -> dict[str, TrainingPassage]:
    return {_key(file, t, x.strip()): TrainingPassage(_key(file, t, x.strip()), t, x.strip()) for t, x in rows}


def _read_squad(file: Path) -> tuple[dict[str, TrainingPassage], list[QAPair]]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TrainingError(f"{file} is not valid JSON ({exc}).", "Give a SQuAD-format JSON file.") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise TrainingError(f"{file} is not SQuAD format (no top-level 'data' list).", "Use .jsonl for plain text.")
    passages, questions = {}, []
    for article in data["data"]:
        title = str(article.get("title", "")).replace("_", " ")
        for para in article.get("paragraphs", []):
            text = para["context"].strip()
            key = _key(file, title, text)
            passages[key] = TrainingPassage(key, title, text)
            for qa in para.get("qas", []):
                answers = [a["text"].strip() for a in qa.get("answers", []) if a.get("text", "").strip()]
                if answers:
                    questions.append(QAPair(key, qa["question"].strip(), answers[0], str(qa.get("id", ""))))
    return passages, questions


def _read_jsonl(file: Path) -> list[tuple[str, str]]:
    rows = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise TrainingError(
                f"{file}:{n} is not valid JSON.", "Each line must be an object with a 'text' field."
            ) from None
        text = row.get("text") or row.get("context") or row.get("contents")
        if not isinstance(text, str):
            raise TrainingError(f"{file}:{n} has no 'text' field.", "Each line must be an object with a 'text' field.")
        rows.append((str(row.get("title", "")), text))
    return rows


def split_by_passage(keys: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded split of passage keys into (train, validation)."""
    order = sorted(keys)
    random.Random(seed).shuffle(order)
    n_val = int(round(len(order) * val_fraction))
    if val_fraction > 0 and len(order) > 1:
        n_val = max(1, n_val)
    return order[n_val:], order[:n_val]
