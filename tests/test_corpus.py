"""corpus.read_corpus: every format, every bad-input case, skip_bad, stdin."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from paths import SAMPLE_DATA

from cachegraft_cli.corpus import Passage, content_id, read_corpus
from cachegraft_cli.errors import CorpusError

SAMPLE = SAMPLE_DATA / "corpus.jsonl"


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


def jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def error_of(reader) -> str:
    with pytest.raises(CorpusError) as info:
        list(reader)
    assert "\n" not in info.value.message
    return info.value.message


# ---------------------------------------------------------------- formats


def test_jsonl_fields_metadata_and_lines(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"id": "a", "title": "T", "text": " Alpha. ", "lang": "en"},
                                             "", {"id": 7, "text": "Beta"}))
    passages = list(read_corpus(path))
    assert passages == [
        Passage("a", "T", "Alpha.", {"lang": "en"}, str(path), 1),
        Passage("7", "", "Beta", {}, str(path), 3),
    ]


def test_sample_corpus_reads():
    passages = list(read_corpus(SAMPLE))
    assert len(passages) == 24 and len({p.id for p in passages}) == 24
    assert all(60 <= len(p.text.split()) <= 150 and p.title for p in passages)


def test_missing_id_is_derived_from_content(tmp_path):
    path = write(tmp_path / "c.ndjson", jsonl({"title": "T", "text": "Gamma"}))
    (p,) = read_corpus(path)
    assert p.id == content_id("T", "Gamma") and len(p.id) == 16


def test_custom_fields_map_columns(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"doc": "x1", "body": "Delta", "name": "N", "text": "kept"}))
    (p,) = read_corpus(path, id_field="doc", text_field="body", title_field="name")
    assert (p.id, p.title, p.text, p.metadata) == ("x1", "N", "Delta", {"text": "kept"})


def test_csv_with_quoted_multiline_field(tmp_path):
    path = write(tmp_path / "c.csv", 'id,text,title,year\n1,"two\nlines, quoted",First,1999\n2,plain,,2001\n')
    a, b = read_corpus(path)
    assert (a.id, a.text, a.title, a.metadata, a.line) == ("1", "two\nlines, quoted", "First", {"year": "1999"}, 2)
    assert (b.id, b.title, b.line) == ("2", "", 4)


def test_tsv_with_mapped_columns(tmp_path):
    path = write(tmp_path / "c.tsv", "pid\tpassage\theading\n9\tEpsilon text\tE\n")
    (p,) = read_corpus(path, id_field="pid", text_field="passage", title_field="heading")
    assert (p.id, p.text, p.title, p.metadata) == ("9", "Epsilon text", "E", {})


def test_csv_without_id_column_derives_ids(tmp_path):
    path = write(tmp_path / "c.csv", "text\nZeta\n")
    (p,) = read_corpus(path)
    assert p.id == content_id("", "Zeta")


def test_directory_of_text_files(tmp_path):
    write(tmp_path / "docs" / "guide" / "setup.md", "\n# Setting up\n\nInstall it.\n")
    write(tmp_path / "docs" / "notes.txt", "Plain notes.\n")
    write(tmp_path / "docs" / "mid.md", "Intro line.\n## Later heading\nMore.\n")
    write(tmp_path / "docs" / ".hidden.md", "# secret")
    write(tmp_path / "docs" / "image.png", b"\x89PNG")
    got = {p.id: p for p in read_corpus(tmp_path / "docs")}
    assert sorted(got) == ["guide/setup", "mid", "notes"]
    assert (got["guide/setup"].title, got["guide/setup"].text) == ("Setting up", "Install it.")
    assert (got["notes"].title, got["notes"].text) == ("notes", "Plain notes.")
    assert got["mid"].title == "Later heading" and got["mid"].text.startswith("Intro line.")
    assert got["guide/setup"].metadata == {"path": "guide/setup.md"}


def squad(*articles) -> str:
    return json.dumps({"version": "1.1", "data": [
        {"title": t, "paragraphs": [{"context": c, "qas": [{"id": f"{t}{i}", "question": "?"}]}
                                    for i, c in enumerate(ps)]} for t, ps in articles]})


def test_squad_json_ids_are_slug_and_index(tmp_path):
    path = write(tmp_path / "dev.json", squad(("Super_Bowl 50", ["P0", "P1"]), ("Other", ["Q0"]),
                                              ("super bowl 50", ["R0"])))
    ps = list(read_corpus(path))
    assert [p.id for p in ps] == ["super-bowl-50/0", "super-bowl-50/1", "other/0", "super-bowl-50~2/0"]
    assert ps[0].title == "Super Bowl 50" and ps[1].text == "P1"
    assert ps[1].metadata == {"article": 0, "paragraph": 1, "qa_ids": ["Super_Bowl 501"]}


def test_json_list_of_passages_and_format_override(tmp_path):
    path = write(tmp_path / "list.data", json.dumps([{"id": "a", "text": "Eta"}]))
    (p,) = read_corpus(path, format="json")
    assert (p.id, p.text) == ("a", "Eta")


def test_stdin_jsonl_bytes_and_text():
    data = jsonl({"id": "s1", "text": "from stdin"})
    for stream in (io.BytesIO(data.encode()), io.StringIO(data)):
        (p,) = read_corpus("-", stdin=stream)
        assert (p.id, p.source, p.line) == ("s1", "-", 1)


def test_stdin_error_names_stdin():
    reader = read_corpus("-", stdin=io.BytesIO(b'{"id": 1}\n'))
    assert error_of(reader).startswith("<stdin>:1: missing text")


# ---------------------------------------------------------------- bad input


BAD_JSONL = jsonl(
    {"id": "ok1", "text": "fine"},
    '{"id": "bad", "text": "x"',
    {"id": "empty", "text": "   "},
    {"title": "no text"},
    {"id": "ok1", "text": "fine"},
    {"id": "ok1", "text": "other text"},
    "[1, 2]",
).encode() + b'{"id": "latin", "text": "caf\xe9"}\n' + jsonl({"id": "ok2", "text": "also fine"}).encode()


@pytest.mark.parametrize("bad, expected", [
    (b'{"id": "bad", "text": "x"', "malformed JSON (Expecting ',' delimiter: column 26)"),
    (b'{"id": "e", "text": "   "}', "missing text (field 'text' is absent or empty)"),
    (b'{"id": "n", "text": 5}', "missing text (field 'text' is a int, not a string)"),
    (b'{"id": "ok1", "text": "other"}', "duplicate id ('ok1' seen before with different text)"),
    (b"[1, 2]", "not an object (got a JSON list)"),
    (b'{"id": "l", "text": "caf\xe9"}', "not UTF-8 (byte 0xe9 at column 25)"),
])
def test_each_bad_line_names_file_and_line(tmp_path, bad, expected):
    path = write(tmp_path / "c.jsonl", b'{"id": "ok1", "text": "fine"}\n' + bad + b"\n")
    assert error_of(read_corpus(path)) == f"{path}:2: {expected}"


def test_hint_mentions_skip_bad(tmp_path):
    path = write(tmp_path / "c.jsonl", "{oops\n")
    with pytest.raises(CorpusError) as info:
        list(read_corpus(path))
    assert "--skip-bad" in info.value.hint and info.value.exit_code == 8


def test_skip_bad_counts_by_reason(tmp_path):
    path = write(tmp_path / "c.jsonl", BAD_JSONL)
    reader = read_corpus(path, skip_bad=True)
    assert [p.id for p in reader] == ["ok1", "ok2"]
    assert reader.skipped == {"malformed JSON": 1, "missing text": 2, "duplicate id": 1,
                              "not an object": 1, "not UTF-8": 1}
    assert reader.examples[0].startswith(f"{path}:2: malformed JSON")
    assert reader.validate() == 2 and sum(reader.skipped.values()) == 6  # counters reset per pass


def test_same_id_same_text_is_deduplicated_silently(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"id": "a", "text": "same"}, {"id": "a", "text": "same"}))
    reader = read_corpus(path)
    assert len(list(reader)) == 1 and not reader.skipped


def test_non_default_id_field_missing_is_an_error(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"id": "a", "text": "x"}))
    assert "missing id (field 'doc_id'" in error_of(read_corpus(path, id_field="doc_id"))


def test_csv_unknown_column_names_file_and_columns(tmp_path):
    path = write(tmp_path / "c.csv", "id,body\n1,x\n")
    message = error_of(read_corpus(path))
    assert message == f"{path}: no column 'text'; the file has columns: id, body"
    message = error_of(read_corpus(path, text_field="body", title_field="heading"))
    assert "no column 'heading'" in message


def test_csv_bad_rows_and_bytes(tmp_path):
    path = write(tmp_path / "c.tsv", b"id\ttext\n1\tok\n2\n3\tcaf\xe9\n4\t\n5\tfine\n")
    assert error_of(read_corpus(path)).startswith(f"{path}:3: bad row (1 fields, the header has 2)")
    reader = read_corpus(path, skip_bad=True)
    assert [p.id for p in reader] == ["1", "5"]
    assert reader.skipped == {"bad row": 1, "not UTF-8": 1, "missing text": 1}
    assert any(e.startswith(f"{path}:4: not UTF-8") for e in reader.examples)


def test_directory_bad_file(tmp_path):
    write(tmp_path / "d" / "a.txt", b"line one\nbad \xff byte\n")
    write(tmp_path / "d" / "b.md", "   \n")
    message = error_of(read_corpus(tmp_path / "d"))
    assert message.startswith(f"{tmp_path / 'd' / 'a.txt'}:2: not UTF-8")
    reader = read_corpus(tmp_path / "d", skip_bad=True)
    assert list(reader) == [] and reader.skipped == {"not UTF-8": 1, "missing text": 1}


def test_malformed_json_file_names_line(tmp_path):
    path = write(tmp_path / "dev.json", '{"data": [\n {"title": "x",\n ]}')
    assert error_of(read_corpus(path)).startswith(f"{path}:3: malformed JSON")


def test_squad_empty_context(tmp_path):
    path = write(tmp_path / "dev.json", squad(("A", ["ok", " "])))
    assert error_of(read_corpus(path)) == f"{path}: data[0].paragraphs[1]: missing text (no \"context\")"


@pytest.mark.parametrize("name, kwargs, fragment", [
    ("nothing.jsonl", {}, "no such file or directory"),
    ("c.parquet", {}, "cannot tell the corpus format"),
    ("c.jsonl", {"format": "xml"}, "unknown corpus format 'xml'"),
    ("c.jsonl", {"format": "dir"}, "is a file, which --format dir cannot read"),
])
def test_source_errors_are_immediate(tmp_path, name, kwargs, fragment):
    if name != "nothing.jsonl":
        write(tmp_path / name, "")
    with pytest.raises(CorpusError, match=fragment):
        read_corpus(tmp_path / name, **kwargs)
