"""QA benchmarks: SQuAD JSON, JSONL (FlashRAG style) and Hugging Face datasets.

A benchmark is its sampled questions plus its corpus. The corpus is, by
default, every paragraph of the articles the sampled questions come from
(`corpus="articles"`), or the whole set (`corpus="full"`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cachegraft_cli.corpus import slugify  # the corpus reader's ids: one definition
from cachegraft_cli.errors import DatasetError, HubUnreachableError, UsageError

CORPUS_MODES = ("articles", "full")
_OPTIONS = ("corpus", "articles", "limit", "passage_tokens")
_MISSING_HINT = "Check the path after -B name=; for a Hugging Face dataset write -B name=hf:DATASET[:SPLIT]."
HF_COLUMNS = ("id", "question", "answers", "context", "title", "gold_ids")


@dataclass(frozen=True)
class QAExample:
    id: str
    question: str
    answers: list[str]
    gold_ids: list[str] = field(default_factory=list)
    title: str = ""


@dataclass(frozen=True)
class CorpusPassage:
    id: str
    title: str
    text: str

    def to_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "text": self.text}


@dataclass
class Benchmark:
    name: str
    questions: list[QAExample]
    passages: list[CorpusPassage]
    max_passage_tokens: int | None = None  # set by `rechunk`: encode it with this --max-passage-tokens

    def passage_dicts(self) -> list[dict]:
        return [p.to_dict() for p in self.passages]


@dataclass(frozen=True)
class DatasetSpec:
    """Where a benchmark comes from. `kind` is squad, jsonl or hf."""

    name: str
    source: str
    kind: str
    split: str = "validation"
    config: str | None = None
    columns: dict = field(default_factory=dict)
    corpus_path: str | None = None
    articles: int | None = None  # overrides the run's --articles for this benchmark
    limit: int | None = None  # overrides the run's --limit for this benchmark
    passage_tokens: int | None = None  # re-chunk the corpus as `encode --max-passage-tokens N` stores it

    def to_dict(self) -> dict:
        d = {
            "name": self.name, "source": self.source, "kind": self.kind, "split": self.split,
            "config": self.config, "columns": dict(self.columns), "corpus_path": self.corpus_path,
        }
        for key in ("articles", "limit", "passage_tokens"):  # absent when unset, so older run directories still resume
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


def squad_passage_id(title: str, index: int, occurrence: int = 1) -> str:
    """Stable id of paragraph `index` (0-based) of the article `title`.

    `occurrence` > 1 marks a later article whose title slug was already used
    in the same file (`<slug>~2/...`), matching `corpus.py`.
    """
    slug = slugify(title)
    return f"{slug if occurrence == 1 else f'{slug}~{occurrence}'}/{index}"


def _context_id(context: str) -> str:
    return "ctx-" + hashlib.sha1(context.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------- spec parsing


def parse_dataset_spec(text: str) -> DatasetSpec:
    """Parse `[name=]path.json|path.jsonl` or `[name=]hf:DATASET[#CONFIG][:SPLIT][?col=field&...]`.

    Column mapping keys: id, question, answers, context, title, gold_ids; a
    field may be dotted (`answers.text`). For JSONL `?corpus=PATH` names a
    separate passage file (JSONL with id, title, text or FlashRAG `contents`).
    `?articles=N` samples this benchmark's questions from N articles and
    `?limit=N` samples N questions (overriding --articles / --limit, so each
    benchmark can be sized on its own). `?passage_tokens=N` joins each
    article's passages and splits them into chunks of at most N tokens, as
    `encode --max-passage-tokens N` does (`rechunk`).
    """
    name, _, body = text.partition("=") if _has_name(text) else ("", "", text)
    body, _, query = body.partition("?")
    options = _parse_query(query, text)
    corpus_path = options.pop("corpus", None)
    articles = _count_option("articles", options.pop("articles", None), text)
    limit = _count_option("limit", options.pop("limit", None), text)
    passage_tokens = _count_option("passage_tokens", options.pop("passage_tokens", None), text)
    from cachegraft_cli.encoding.plan import MIN_PASSAGE_TOKENS  # encode's own bound

    if passage_tokens is not None and passage_tokens < MIN_PASSAGE_TOKENS:
        raise UsageError(f"Bad passage_tokens={passage_tokens} in {text!r}: chunks hold at least "
                         f"{MIN_PASSAGE_TOKENS} tokens.", "Give e.g. ?passage_tokens=512.")
    if name:
        _check_name(name, text)
    if body.startswith("hf:"):
        spec = _hf_spec(name, body[3:], options, corpus_path)
    elif options:
        raise UsageError(f"Column mapping is only for hf: datasets: {text!r}.")
    else:
        kind = "jsonl" if body.endswith(".jsonl") else "squad"
        spec = DatasetSpec(name or _safe_name(Path(body).stem), body, kind, corpus_path=corpus_path)
    return dataclasses.replace(spec, articles=articles, limit=limit, passage_tokens=passage_tokens)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _check_name(name: str, text: str) -> None:
    """A benchmark name names files and stores (`<stores>/<name>-...`): a plain name, never a path."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise UsageError(f"Bad benchmark name {name!r} in {text!r}: names are letters, digits and . _ + - only.",
                         "Write -B NAME=FILE with a plain NAME, e.g. -B squad=dev.json.")


def _safe_name(stem: str) -> str:
    return stem if _NAME.fullmatch(stem) and ".." not in stem else slugify(stem)


def _count_option(key: str, value: str | None, text: str) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"Bad {key}={value!r} in {text!r}.", f"Give a whole number >= 1, e.g. ?{key}=2.")
    return int(value)


def _has_name(text: str) -> bool:
    head = text.split("?", 1)[0]
    return "=" in head and not head.startswith("hf:")


def _parse_query(query: str, text: str) -> dict:
    options = {}
    for part in filter(None, query.split("&")):
        key, sep, value = part.partition("=")
        if not sep or (key not in HF_COLUMNS and key not in _OPTIONS):
            raise UsageError(f"Bad dataset option {part!r} in {text!r}.",
                             f"Use key=value with keys {', '.join(HF_COLUMNS + _OPTIONS)}.")
        options[key] = value
    return options


def _hf_spec(name: str, body: str, columns: dict, corpus_path: str | None) -> DatasetSpec:
    split = "validation"
    head, sep, tail = body.rpartition(":")
    if sep and "/" not in tail:
        body, split = head, tail
    dataset, _, config = body.partition("#")
    default_name = slugify(Path(dataset).name)
    return DatasetSpec(name or default_name, dataset, "hf", split, config or None, columns, corpus_path)


# ---------------------------------------------------------------- readers


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise DatasetError(f"Dataset file not found: {path}.", _MISSING_HINT) from None
    except IsADirectoryError:
        raise DatasetError(f"Dataset {path} is a directory, not a file.", _MISSING_HINT) from None
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path} is not valid JSON: {exc}.") from None
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path} is not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}).",
                           "Re-save the file as UTF-8.") from None


def read_squad(path: str) -> tuple[list[QAExample], list[CorpusPassage]]:
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise DatasetError(f"{path} is not SQuAD format (no top-level 'data' list).")
    questions, passages, slugs = [], [], Counter[str]()
    for a, article in enumerate(data["data"]):
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs", []), list):
            raise DatasetError(f"{path}: data[{a}] is not an article with a \"paragraphs\" list.", _SQUAD_HINT)
        raw_title = str(article.get("title", ""))
        slugs[slugify(raw_title)] += 1
        title = raw_title.replace("_", " ")  # display title, as the corpus reader gives it
        for index, paragraph in enumerate(article.get("paragraphs", [])):
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("context"), str) \
                    or not isinstance(paragraph.get("qas", []), list):
                raise DatasetError(f"{path}: data[{a}].paragraphs[{index}] needs a \"context\" string and a "
                                   f"\"qas\" list.", _SQUAD_HINT)
            pid = squad_passage_id(raw_title, index, slugs[slugify(raw_title)])
            passages.append(CorpusPassage(pid, title, paragraph["context"].strip()))
            questions += [_squad_question(qa, pid, title, path) for qa in paragraph.get("qas", [])]
    return questions, passages


def _squad_question(qa, pid: str, title: str, path: str) -> QAExample:
    where = f"{path}: question {qa.get('id')!r}" if isinstance(qa, dict) else f"{path}: paragraph {pid!r}"
    if not isinstance(qa, dict) or not isinstance(qa.get("question"), str) or "id" not in qa:
        raise DatasetError(f"{where}: each entry of \"qas\" needs an \"id\" and a \"question\" string.",
                           _SQUAD_HINT)
    answers = qa.get("answers", [])
    if not isinstance(answers, list) or not all(isinstance(a, dict) and isinstance(a.get("text"), str)
                                                for a in answers):
        raise DatasetError(f"{where}: \"answers\" must be a list of {{\"text\": ...}} objects, "
                           f"not a {type(answers).__name__}.", _SQUAD_HINT)
    return QAExample(str(qa["id"]), qa["question"], [a["text"] for a in answers], [pid], title)


_SQUAD_HINT = 'SQuAD questions look like {"id": "q1", "question": "...", "answers": [{"text": "..."}]}.'


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    line_no = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, 1):
                if line.strip():
                    rows.append(_json_line(line, path, line_no))
    except FileNotFoundError:
        raise DatasetError(f"Dataset file not found: {path}.", _MISSING_HINT) from None
    except IsADirectoryError:
        raise DatasetError(f"Dataset {path} is a directory, not a file.", _MISSING_HINT) from None
    except UnicodeDecodeError:
        raise DatasetError(f"{path}:{line_no + 1}: not UTF-8.", "Re-save the file as UTF-8.") from None
    return rows


def _json_line(line: str, path: str, line_no: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{line_no}: invalid JSON ({exc.msg}).") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{path}:{line_no}: expected a JSON object.")
    return row


def _as_answers(value, where: str = "") -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and "text" in value:
        return _as_answers(value["text"], where)
    if not isinstance(value, list) or any(isinstance(a, dict) and not isinstance(a.get("text"), str) for a in value):
        raise DatasetError(f"{where}: 'answers' must be a string, a list of strings or of {{\"text\": ...}} objects, "
                           f"not {json.dumps(value)[:60]}.")
    return [a["text"] if isinstance(a, dict) else str(a) for a in value]


def rows_to_examples(rows: list[dict], where: str) -> tuple[list[QAExample], list[CorpusPassage]]:
    """Rows with id, question, answers and optional context, title, gold_ids."""
    questions, passages = [], []
    seen: dict[tuple[str, str], str] = {}  # (title, context) -> passage id
    per_title: dict[str, int] = {}
    for n, row in enumerate(rows):
        if not row.get("question") or row.get("answers") is None:
            raise DatasetError(f"{where}: row {n + 1} lacks 'question' or 'answers'.")
        if not isinstance(row["question"], str):
            raise DatasetError(f"{where}: row {n + 1}: 'question' must be a string, "
                               f"not {json.dumps(row['question'])[:40]}.")
        title = str(row.get("title") or "")
        gold = [str(g) for g in (row.get("gold_ids") or [])]
        context = row.get("context")
        if context:
            pid = seen.get((title, context)) or _new_context_id(title, context, gold, per_title)
            if (title, context) not in seen:
                seen[(title, context)] = pid
                passages.append(CorpusPassage(pid, title, context))
            gold = gold or [pid]
        qid = str(row.get("id", n))
        answers = _as_answers(row["answers"], f"{where}: row {n + 1}")
        questions.append(QAExample(qid, str(row["question"]), answers, gold, title))
    return questions, passages


def _new_context_id(title: str, context: str, gold: list[str], per_title: dict) -> str:
    """Given gold id, else the SQuAD convention within a title, else a content hash."""
    if gold:
        return gold[0]
    if not title:
        return _context_id(context)
    index = per_title.get(title, 0)
    per_title[title] = index + 1
    return squad_passage_id(title, index)


def read_corpus_jsonl(path: str) -> list[CorpusPassage]:
    passages = []
    for n, row in enumerate(_read_jsonl(path)):
        if "id" not in row or not (row.get("text") or row.get("contents")):
            raise DatasetError(f"{path}: passage {n + 1} lacks 'id' or 'text'/'contents'.")
        title, text = row.get("title", ""), row.get("text")
        if text is None:  # FlashRAG: contents = '"title"\ntext'
            first, _, rest = row["contents"].partition("\n")
            title, text = (first.strip('"'), rest) if rest else (title, first)
        passages.append(CorpusPassage(str(row["id"]), str(title or ""), text))
    return passages


def _get_path(row: dict, dotted: str):
    value = row
    for key in dotted.split("."):
        if isinstance(value, list):
            value = [v[key] for v in value]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            raise DatasetError(f"Column {dotted!r} not found in dataset row (keys: {sorted(row)}).")
    return value


def map_columns(row: dict, columns: dict) -> dict:
    out = {}
    for key in HF_COLUMNS:
        source = columns.get(key, key)
        if key in columns or _has_top(row, source):
            out[key] = _get_path(row, source)
    return out


def _has_top(row: dict, source: str) -> bool:
    return source.split(".")[0] in row


def load_hf_rows(spec: DatasetSpec) -> list[dict]:
    dataset = _load_hf(spec)
    return [map_columns(dict(row), spec.columns) for row in dataset]


def _load_hf(spec: DatasetSpec):
    import datasets  # lazy: heavy

    local = Path(spec.source)
    try:
        if local.is_dir() and _is_saved_dataset(local):
            loaded = datasets.load_from_disk(str(local))
            return loaded[spec.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(spec.source, spec.config, split=spec.split)
    except (ConnectionError, OSError) as exc:
        if local.exists():
            raise DatasetError(f"Could not read dataset {spec.source}: {exc}.") from None
        raise HubUnreachableError(f"Could not load dataset {spec.source!r}: {exc}.",
                                  "Check the name and your connection, or point at a local copy.") from None
    except (KeyError, ValueError) as exc:
        raise DatasetError(f"Could not load split {spec.split!r} of {spec.source}: {exc}.") from None


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").exists() or (path / "dataset_dict.json").exists()


def read_dataset(spec: DatasetSpec) -> tuple[list[QAExample], list[CorpusPassage]]:
    if spec.kind == "squad":
        questions, passages = read_squad(spec.source)
    elif spec.kind == "jsonl":
        questions, passages = rows_to_examples(_read_jsonl(spec.source), spec.source)
    elif spec.kind == "hf":
        questions, passages = rows_to_examples(load_hf_rows(spec), spec.source)
    else:
        raise UsageError(f"Unknown dataset kind {spec.kind!r}.")
    if spec.corpus_path:
        passages = _merge_corpus(passages, read_corpus_jsonl(spec.corpus_path))
    if not questions:
        raise DatasetError(f"No questions in {spec.source}.")
    return questions, passages


def _merge_corpus(own: list[CorpusPassage], extra: list[CorpusPassage]) -> list[CorpusPassage]:
    ids = {p.id for p in extra}
    return extra + [p for p in own if p.id not in ids]


# ---------------------------------------------------------------- sampling


def sample_questions(questions: list[QAExample], limit: int | None, seed: int) -> list[QAExample]:
    """A seeded sample of `limit` questions, kept in dataset order."""
    if limit is None or limit >= len(questions):
        return list(questions)
    chosen = sorted(random.Random(seed).sample(range(len(questions)), limit))
    return [questions[i] for i in chosen]


def restrict_articles(questions: list[QAExample], articles: int | None, seed: int) -> list[QAExample]:
    """Questions of `articles` seeded-sampled article titles (all when None)."""
    titles = sorted({q.title for q in questions})
    if articles is None or articles >= len(titles):
        return list(questions)
    keep = set(random.Random(seed).sample(titles, articles))
    return [q for q in questions if q.title in keep]


def select_corpus(questions: list[QAExample], passages: list[CorpusPassage], mode: str) -> list[CorpusPassage]:
    """`full`: every passage. `articles`: the passages of the articles holding a gold passage.

    Falls back to the full corpus when a question has no gold passage (its
    article is unknown). Untitled passages are their own article.
    """
    if mode not in CORPUS_MODES:
        raise UsageError(f"Unknown corpus mode {mode!r}.", f"Use one of {', '.join(CORPUS_MODES)}.")
    if mode == "full" or any(not q.gold_ids for q in questions):
        return list(passages)
    gold = {g for q in questions for g in q.gold_ids}
    titles = {p.title for p in passages if p.id in gold and p.title}
    return [p for p in passages if p.id in gold or (p.title and p.title in titles)]


def load_benchmark(spec: DatasetSpec | str, limit: int | None = None, seed: int = 0,
                   corpus: str = "articles", articles: int | None = None) -> Benchmark:
    """`articles` first restricts the questions to that many seeded-sampled
    articles, so the `articles` corpus stays small enough for a CPU run."""
    spec = parse_dataset_spec(spec) if isinstance(spec, str) else spec
    questions, passages = read_dataset(spec)
    articles = spec.articles if spec.articles is not None else articles
    limit = spec.limit if spec.limit is not None else limit
    sampled = sample_questions(restrict_articles(questions, articles, seed), limit, seed)
    return Benchmark(spec.name, sampled, select_corpus(sampled, passages, corpus))



# ---------------------------------------------------------------- re-chunking


def rechunk(bench: Benchmark, template, tokens: int) -> Benchmark:
    """The benchmark with its corpus as `encode --max-passage-tokens tokens` stores it: each
    article's passages joined into one document (a blank line between them, in corpus order;
    an untitled passage is its own document) and split into chunks of at most `tokens` tokens
    of `template`'s passage block. A question's gold passages become the chunks that overlap
    its gold passage's text. Chunk ids are `encode`'s: `<document>#<i>`, or the document's
    id when it fits whole."""
    from cachegraft_cli.corpus import Passage
    from cachegraft_cli.encoding.plan import split_passage

    passages: list[CorpusPassage] = []
    gold_of: dict[str, list[str]] = {}
    for doc_id, title, text, spans in _documents(bench.passages):
        for chunk in split_passage(Passage(doc_id, title, text), template, tokens):
            a, b = chunk.span or (0, len(text))
            passages.append(CorpusPassage(chunk.id, title, chunk.text))
            for pid, (start, end) in spans.items():
                if start < b and a < end:
                    gold_of.setdefault(pid, []).append(chunk.id)
    questions = [dataclasses.replace(q, gold_ids=list(dict.fromkeys(c for g in q.gold_ids for c in gold_of.get(g, []))))
                 for q in bench.questions]
    return Benchmark(bench.name, questions, passages, tokens)


def _documents(passages: list[CorpusPassage]) -> list[tuple[str, str, str, dict[str, tuple[int, int]]]]:
    """(id, title, text, {passage id: its character span in text}) per article, in corpus order."""
    groups: dict[tuple[str, str], list[CorpusPassage]] = {}  # (title, "") or, untitled, ("", id): in corpus order
    for p in passages:
        groups.setdefault((p.title, "") if p.title else ("", p.id), []).append(p)
    docs, ids = [], Counter[str]()
    for (title, _), group in groups.items():
        slug = slugify(title) if title else group[0].id
        ids[slug] += 1
        doc_id = slug if ids[slug] == 1 else f"{slug}~{ids[slug]}"
        text, spans = "", {}
        for p in group:
            body = p.text.strip()
            start = len(text) + (2 if text else 0)
            text = f"{text}\n\n{body}" if text else body
            spans[p.id] = (start, start + len(body))
        docs.append((doc_id, title, text, spans))
    return docs
