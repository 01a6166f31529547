"""Read a corpus into `Passage`s: JSONL, CSV, TSV, a directory of .txt/.md
files, a SQuAD-format JSON file, or `-` (JSONL on stdin).

Reading is lazy: `read_corpus` checks that the source exists and what format
it is, then each iteration streams the file. Bad input raises `CorpusError`
with a one-line message `FILE:LINE: what` and a hint; with `skip_bad=True`
the bad record is counted in `reader.skipped` (by reason) and skipped.

Ids:
- JSONL / CSV / TSV / JSON list: the `id_field` value. When the default `id`
  field is absent, the id is derived from the content: the first 16 hex digits
  of sha256(title + "\\n" + text), so the same passage always gets the same id.
  A non-default `id_field` that is absent is an error.
- directory: the file's path relative to the directory, without extension,
  with `/` separators (`guides/setup.md` -> `guides/setup`).
- SQuAD JSON: `<title-slug>/<paragraph-index>`, e.g. `super-bowl-50/3`
  (slug: lowercase, runs of non-alphanumerics -> `-`); a slug already used by
  an earlier article gets `~2`, `~3`, ... in file order.

The same id twice with the same title and text is silently deduplicated; with
different content it is an error (or skipped as `duplicate id`).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from cachegraft_cli.checks import unusable_character
from cachegraft_cli.errors import CorpusError

SKIP_HINT = "Fix the input or pass --skip-bad to skip bad records."
FORMATS = ("jsonl", "csv", "tsv", "json", "dir")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".json": "json"}
_TEXT_SUFFIXES = (".txt", ".md", ".markdown")
_MAX_EXAMPLES = 10


@dataclass
class Passage:
    id: str
    title: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    line: int | None = None


class _Bad(Exception):
    """One bad record: `reason` is the counter key, `detail` the message tail."""

    def __init__(self, where: str, reason: str, detail: str = ""):
        super().__init__(where)
        self.where, self.reason, self.detail = where, reason, detail

    def message(self) -> str:
        tail = f" ({self.detail})" if self.detail else ""
        return f"{self.where}: {self.reason}{tail}"


@dataclass
class _Fields:
    id: str = "id"
    text: str = "text"
    title: str = "title"

    @property
    def id_required(self) -> bool:
        return self.id != "id"


def content_id(title: str, text: str) -> str:
    """The derived id of a passage without one (documented in the module)."""
    return hashlib.sha256(f"{title}\n{text}".encode()).hexdigest()[:16]


def slugify(title: str) -> str:
    """Lowercase, runs of non-alphanumerics -> '-' (passage ids of SQuAD files, here and in `evaluate`)."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "untitled"


class CorpusReader:
    """Iterable of `Passage`. Each iteration re-reads the source (stdin from its
    spooled copy) and resets `skipped` (Counter by reason) and `examples` (first messages)."""

    def __init__(self, source: str, fmt: str, fields: _Fields, skip_bad: bool, stdin: IO | None):
        self.source, self.format, self.fields = source, fmt, fields
        self.skip_bad, self._stdin = skip_bad, stdin
        self.skipped: Counter[str] = Counter()
        self.examples: list[str] = []
        self.count = 0
        self._spool: IO[bytes] | None = None  # stdin, copied to a temp file on first read
        self.records: list = []  # the "records" format only (`from_records`)

    def __iter__(self) -> Iterator[Passage]:
        self.skipped, self.examples, self.count = Counter(), [], 0
        seen: dict[str, bytes] = {}
        for item in self._records():
            try:
                passage = item()
                if self._is_new(passage, seen):
                    self.count += 1
                    yield passage
            except _Bad as bad:
                self._reject(bad)

    def validate(self) -> int:
        """Read everything once; return the number of passages (raises on bad input)."""
        return sum(1 for _ in self)

    def _reject(self, bad: _Bad) -> None:
        if not self.skip_bad:
            raise CorpusError(bad.message(), SKIP_HINT)
        self.skipped[bad.reason] += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(bad.message())

    def _is_new(self, p: Passage, seen: dict[str, bytes]) -> bool:
        digest = hashlib.sha256(f"{p.title}\n{p.text}".encode()).digest()
        if p.id not in seen:
            seen[p.id] = digest
            return True
        if seen[p.id] == digest:
            return False
        raise _Bad(_where(p.source, p.line), "duplicate id", f"{p.id!r} seen before with different text")

    def _records(self) -> Iterable[Any]:
        """Callables building one Passage each or raising `_Bad` (so a bad record is skippable)."""
        readers = {"jsonl": _jsonl_records, "csv": _csv_records, "tsv": _csv_records,
                   "json": _json_records, "dir": _dir_records, "records": _memory_records}
        return readers[self.format](self)

    def open_binary(self) -> tuple[IO, bool]:
        """(stream, whether to close it). Stdin is copied to a temporary file as it is first
        read (on disk, not in memory), so it can be read again like a file."""
        if self.source == "-":
            if self._spool is None:
                self._spool = _spool(self._stdin if self._stdin is not None else sys.stdin)
            self._spool.seek(0)
            return self._spool, False
        return open(self.source, "rb"), True


def _spool(stream: IO) -> IO[bytes]:
    import tempfile

    spool = tempfile.TemporaryFile(prefix="cachegraft-stdin-")  # not a `with`: it lives as long as the reader
    source = getattr(stream, "buffer", stream)
    while True:
        block = source.read(1 << 20)
        if not block:
            break
        spool.write(block.encode("utf-8", "surrogateescape") if isinstance(block, str) else block)
    return spool


def read_corpus(
    source: str | Path,
    *,
    id_field: str = "id",
    text_field: str = "text",
    title_field: str = "title",
    skip_bad: bool = False,
    stdin: IO | None = None,
    format: str | None = None,
) -> CorpusReader:
    """Open a corpus lazily. `format` overrides detection (one of FORMATS)."""
    source = str(source)
    fmt = _detect_format(source, format)
    return CorpusReader(source, fmt, _Fields(id_field, text_field, title_field), skip_bad, stdin)


def from_records(
    records: Iterable[Passage | dict],
    *,
    id_field: str = "id",
    text_field: str = "text",
    title_field: str = "title",
    skip_bad: bool = False,
    name: str = "<records>",
) -> CorpusReader:
    """A corpus of in-memory `Passage`s and/or dicts (checked like JSONL objects; other
    fields become metadata). Hints name records as `name: [i]`."""
    reader = CorpusReader(name, "records", _Fields(id_field, text_field, title_field), skip_bad, None)
    reader.records = list(records)
    return reader


def _memory_records(reader: CorpusReader) -> Iterator[Any]:
    used = {reader.fields.id, reader.fields.text, reader.fields.title}
    for i, rec in enumerate(reader.records):
        if isinstance(rec, Passage):
            yield _passage_item(reader, rec, i)
        else:
            yield _json_list_item(reader, rec, i, used)


def _passage_item(reader: CorpusReader, passage: Passage, i: int):
    """A `Passage` built by the caller, checked as a dict record is (a dataclass checks no types)."""
    def build() -> Passage:
        where = f"{reader.source}: [{i}]"
        text = passage.text
        if not isinstance(text, str) or not text.strip():
            detail = "is empty" if isinstance(text, str) else f"is a {type(text).__name__}, not a string"
            raise _Bad(where, "missing text", f"Passage.text {detail}")
        if passage.id is None or str(passage.id).strip() == "":
            raise _Bad(where, "missing id", "Passage.id is empty")
        pid = _id(passage.id, "id", where)
        who = f"passage {pid!r}: "
        _title(passage.title, "title", where, who)
        _unicode(text, "text", where, who)
        _check_metadata(passage.metadata, where, who)
        # as given (the content hash covers the exact title and text), with a number id as its digits
        return replace(passage, id=passage.id if isinstance(passage.id, str) else pid,
                       title=passage.title if passage.title is not None else "")

    return build


def _detect_format(source: str, override: str | None) -> str:
    if override is not None and override not in FORMATS:
        raise CorpusError(f"unknown corpus format {override!r}", f"Use one of: {', '.join(FORMATS)}.")
    if source == "-":
        if override not in (None, "jsonl"):
            raise CorpusError(f"stdin corpora are JSONL, not {override}", "Pass a file path for other formats.")
        return "jsonl"
    path = Path(source)
    if not path.exists():
        raise CorpusError(f"{source}: no such file or directory", "Check the corpus path.")
    if override and (override == "dir") != path.is_dir():
        kind = "a directory" if path.is_dir() else "a file"
        raise CorpusError(f"{source}: is {kind}, which --format {override} cannot read", "Drop --format or fix it.")
    if override:
        return override
    if path.is_dir():
        return "dir"
    fmt = _EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise CorpusError(
            f"{source}: cannot tell the corpus format from the extension {path.suffix!r}",
            f"Pass --format ({', '.join(FORMATS)}).",
        )
    return fmt


def _where(source: str, line: int | None) -> str:
    name = "<stdin>" if source == "-" else source
    return f"{name}:{line}" if line is not None else name


# ---------------------------------------------------------------- records


def _make_passage(rec: dict, reader: CorpusReader, where: str, line: int | None, used: set[str]) -> Passage:
    """A passage from one JSON object / CSV row; the other fields become metadata. Everything is
    checked here, while the corpus is read before any model loads: a value the store cannot
    write (a list title, a NaN, a set) would otherwise fail, or be mangled, after the models load."""
    f = reader.fields
    text = rec.get(f.text)
    if text is None or (isinstance(text, str) and not text.strip()):
        raise _Bad(where, "missing text", f"field {f.text!r} is absent or empty")
    if not isinstance(text, str):
        raise _Bad(where, "missing text", f"field {f.text!r} is a {type(text).__name__}, not a string")
    pid = rec.get(f.id)
    who = f"passage {pid!r}: " if isinstance(pid, (str, int, float)) and not isinstance(pid, bool) else ""
    title = _title(rec.get(f.title), f.title, where, who)
    text = _unicode(text.strip(), f.text, where, who)
    if pid is None or str(pid).strip() == "":
        if f.id_required:
            raise _Bad(where, "missing id", f"field {f.id!r} is absent or empty")
        pid = content_id(title, text)
    pid = _id(pid, f.id, where)
    meta = {k: v for k, v in rec.items() if k not in used}
    _check_metadata(meta, where, f"passage {pid!r}: ")
    return Passage(pid, title, text, meta, reader.source, line)


def _title(title: Any, name: str, where: str, who: str) -> str:
    """A title is a string (or absent): a list or number would be stored as its repr."""
    if title is None:
        return ""
    if not isinstance(title, str):
        raise _Bad(where, "bad title", f"{who}field {name!r} is a {type(title).__name__}, not a string")
    return _unicode(title.strip(), name, where, who)


def _id(pid: Any, name: str, where: str) -> str:
    """An id is a string or a number (stored as its digits); a list, an object or a bool would be
    stored as its repr. No NUL (the store separates ids with it) and nothing that is not UTF-8."""
    finite = not isinstance(pid, float) or math.isfinite(pid)
    if isinstance(pid, bool) or not isinstance(pid, (str, int, float)) or not finite:
        shown = repr(pid) if len(repr(pid)) <= 40 else repr(pid)[:37] + "..."
        raise _Bad(where, "bad id", f"field {name!r} is {shown} ({type(pid).__name__}), not a string or a number")
    pid = str(pid).strip()
    problem = unusable_character(pid)
    if problem:
        raise _Bad(where, "bad id", f"field {name!r} holds {problem}")
    return pid


def _unicode(value: str, name: str, where: str, who: str = "") -> str:
    """`value`, unless it holds what no UTF-8 store can (a lone surrogate from a JSON escape such
    as "\\ud800", or from text decoded with 'surrogateescape')."""
    problem = unusable_character(value.replace("\0", " "))  # a NUL is fine in text, only not in ids
    if problem:
        raise _Bad(where, "not UTF-8", f"{who}field {name!r} holds {problem}")
    return value


_MAX_DEPTH = 32  # nesting deeper than this is a mistake (or a cycle), not metadata


def _check_metadata(meta: Any, where: str, who: str = "") -> None:
    """Metadata is stored as JSON: strings (UTF-8), finite numbers, booleans, null, lists and
    objects with string keys. The first value that is not is refused, by its key path."""
    problem = _json_problem(meta, "", 0) if isinstance(meta, dict) else \
        f"the metadata is a {type(meta).__name__}, not a dict"
    if problem:
        raise _Bad(where, "bad metadata", f"{who}{problem}; metadata must be plain JSON")


def _json_problem(value: Any, path: str, depth: int) -> str | None:
    shown = f"field {path!r}" if path else "the metadata"
    if value is None or isinstance(value, (bool, int)):
        return None
    if isinstance(value, str):
        problem = unusable_character(value.replace("\0", " "))
        return f"{shown} holds {problem}" if problem else None
    if isinstance(value, float):  # json would write a bare NaN or Infinity, which is not JSON
        return None if math.isfinite(value) else f"{shown} is {value!r}, not a finite number"
    if depth >= _MAX_DEPTH:  # a cycle (a list holding itself) or absurd nesting: name the top field
        return f"field {path.split('[')[0].split('.')[0]!r} is nested more than {_MAX_DEPTH} levels deep"
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
        return next(filter(None, (_json_problem(v, f"{path}[{i}]", depth + 1) for i, v in items)), None)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{shown} has a key {key!r} of type {type(key).__name__}, not a string"
            problem = _json_problem(item, f"{path}.{key}" if path else key, depth + 1)
            if problem:
                return problem
        return None
    return f"{shown} is of type {type(value).__name__}, which JSON cannot hold"


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _Bad(where, "not UTF-8", f"byte 0x{raw[err.start]:02x} at column {err.start + 1}") from None


def _jsonl_records(reader: CorpusReader) -> Iterator[Any]:
    used = {reader.fields.id, reader.fields.text, reader.fields.title}
    stream, owned = reader.open_binary()
    try:
        for lineno, raw in enumerate(stream, 1):
            if isinstance(raw, str):
                raw = raw.encode("utf-8", "surrogateescape")
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if raw.strip():
                yield _jsonl_item(raw, reader, lineno, used)
    finally:
        if owned:
            stream.close()


def _jsonl_item(raw: bytes, reader: CorpusReader, lineno: int, used: set[str]):
    def build() -> Passage:
        where = _where(reader.source, lineno)
        try:
            rec = json.loads(_decode(raw, where).rstrip("\r\n"))
        except json.JSONDecodeError as err:
            raise _Bad(where, "malformed JSON", f"{err.msg}: column {err.pos + 1}") from None
        if not isinstance(rec, dict):
            raise _Bad(where, "not an object", f"got a JSON {type(rec).__name__}")
        return _make_passage(rec, reader, where, lineno, used)

    return build


class _LineDecoder:
    """Decodes a binary file line by line for `csv`, remembering undecodable lines."""

    def __init__(self, stream: IO[bytes]):
        self.stream, self.lineno = stream, 0
        self.bad: dict[int, str] = {}

    def __iter__(self) -> Iterator[str]:
        for raw in self.stream:
            self.lineno += 1
            if self.lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as err:
                self.bad[self.lineno] = f"byte 0x{raw[err.start]:02x} at column {err.start + 1}"
                yield raw.decode("utf-8", "replace")


def _csv_records(reader: CorpusReader) -> Iterator[Any]:
    try:
        yield from _csv_rows(reader)
    except csv.Error as err:  # quoting the csv module cannot parse: the rest of the file cannot be trusted
        raise CorpusError(f"{reader.source}: unreadable CSV ({err}).",
                          "Quote fields holding line breaks or quotes; the file must parse as a whole.") from None


def _csv_rows(reader: CorpusReader) -> Iterator[Any]:
    csv.field_size_limit(2**31 - 1)
    with open(reader.source, "rb") as stream:
        lines = _LineDecoder(stream)
        delimiter = "\t" if reader.format == "tsv" else ","
        rows = csv.reader(lines, delimiter=delimiter)
        header = next(rows, None)
        if header is None:
            return
        if 1 in lines.bad:
            raise CorpusError(f"{_where(reader.source, 1)}: not UTF-8 ({lines.bad[1]})", "Re-save the file as UTF-8.")
        _check_columns(reader, header)
        start = lines.lineno + 1
        for row in rows:
            if row:
                yield _csv_item(reader, header, row, start, lines)
            start = lines.lineno + 1


def _check_columns(reader: CorpusReader, header: list[str]) -> None:
    f = reader.fields
    wanted = [f.text] + ([f.id] if f.id_required else []) + ([f.title] if f.title != "title" else [])
    missing = [c for c in wanted if c not in header]
    if missing:
        raise CorpusError(
            f"{reader.source}: no column {missing[0]!r}; the file has columns: {', '.join(header)}",
            "Name an existing column with --id-field / --text-field / --title-field.",
        )


def _csv_item(reader: CorpusReader, header: list[str], row: list[str], start: int, lines: _LineDecoder):
    end = lines.lineno
    bad = [n for n in range(start, end + 1) if n in lines.bad]

    def build() -> Passage:
        where = _where(reader.source, start)
        if bad:
            raise _Bad(_where(reader.source, bad[0]), "not UTF-8", lines.bad[bad[0]])
        if len(row) != len(header):
            raise _Bad(where, "bad row", f"{len(row)} fields, the header has {len(header)}")
        rec = dict(zip(header, row))
        used = {reader.fields.id, reader.fields.text, reader.fields.title}
        return _make_passage(rec, reader, where, start, used)

    return build


# ---------------------------------------------------------------- JSON file


def _load_json_file(reader: CorpusReader) -> Any:
    raw = Path(reader.source).read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise CorpusError(f"{_where(reader.source, line)}: not UTF-8", "Re-save the file as UTF-8.") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CorpusError(
            f"{_where(reader.source, err.lineno)}: malformed JSON ({err.msg}: column {err.colno})",
            "Fix the file; a JSON file must parse as a whole (use JSONL to skip bad lines).",
        ) from None


def _json_records(reader: CorpusReader) -> Iterator[Any]:
    """A SQuAD-format object (`{"data": [...]}`) or a JSON list of passage objects."""
    doc = _load_json_file(reader)
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        yield from _squad_records(reader, doc["data"])
    elif isinstance(doc, list):
        used = {reader.fields.id, reader.fields.text, reader.fields.title}
        for i, rec in enumerate(doc):
            yield _json_list_item(reader, rec, i, used)
    else:
        raise CorpusError(
            f"{reader.source}: not a SQuAD file (no top-level \"data\" list) nor a list of passages",
            "Use JSONL, CSV/TSV, or SQuAD-format JSON.",
        )


def _json_list_item(reader: CorpusReader, rec: Any, i: int, used: set[str]):
    def build() -> Passage:
        where = f"{reader.source}: [{i}]"
        if not isinstance(rec, dict):
            raise _Bad(where, "not an object", f"got a JSON {type(rec).__name__}")
        return _make_passage(rec, reader, where, None, used)

    return build


def _squad_records(reader: CorpusReader, articles: list) -> Iterator[Any]:
    slugs: Counter[str] = Counter()
    for a, article in enumerate(articles):
        title = str(article.get("title", "")) if isinstance(article, dict) else ""
        base = slugify(title)
        slugs[base] += 1
        slug = base if slugs[base] == 1 else f"{base}~{slugs[base]}"
        paragraphs = article.get("paragraphs", []) if isinstance(article, dict) else []
        for p, para in enumerate(paragraphs):
            yield _squad_item(reader, title.replace("_", " "), f"{slug}/{p}", para, (a, p))


def _squad_item(reader: CorpusReader, title: str, pid: str, para: Any, pos: tuple[int, int]):
    def build() -> Passage:
        where = f"{reader.source}: data[{pos[0]}].paragraphs[{pos[1]}]"
        context = para.get("context") if isinstance(para, dict) else None
        if not isinstance(context, str) or not context.strip():
            raise _Bad(where, "missing text", "no \"context\"")
        qa_ids = [qa.get("id") for qa in para.get("qas", []) if isinstance(qa, dict)]
        meta = {"article": pos[0], "paragraph": pos[1], "qa_ids": qa_ids}
        who = f"passage {pid!r}: "
        _unicode(title, "title", where, who)
        _check_metadata(meta, where, who)
        return Passage(pid, title, _unicode(context.strip(), "context", where, who), meta, reader.source, None)

    return build


# ---------------------------------------------------------------- directory


def _dir_records(reader: CorpusReader) -> Iterator[Any]:
    root = Path(reader.source)
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and path.suffix.lower() in _TEXT_SUFFIXES and not _hidden(rel):
            yield _file_item(reader, path, rel)


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _file_item(reader: CorpusReader, path: Path, rel: Path):
    def build() -> Passage:
        raw = path.read_bytes()
        try:
            content = raw.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise _Bad(_where(str(path), line), "not UTF-8", f"byte 0x{raw[err.start]:02x}") from None
        title, text = split_heading(content)
        if not text.strip():
            raise _Bad(str(path), "missing text", "the file is empty")
        pid = rel.with_suffix("").as_posix()
        return Passage(pid, title or path.stem, text.strip(), {"path": rel.as_posix()}, str(path), None)

    return build


def split_heading(content: str) -> tuple[str, str]:
    """(first markdown heading, text). The heading line is removed from the text
    only when it is the first non-blank line (a leading title)."""
    lines = content.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            first = all(not x.strip() for x in lines[:i])
            body = "\n".join(lines[i + 1:]) if first else content
            return m.group(1), body
    return "", content


__all__ = ["Passage", "CorpusReader", "read_corpus", "content_id", "slugify", "FORMATS"]
