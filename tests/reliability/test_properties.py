"""Property tests (hypothesis): input parsers never fail but with their typed errors, and
round-trip what they are given; codecs round-trip within their documented bounds."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
from faults import record
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from cachegraft_cli.corpus import read_corpus
from cachegraft_cli.errors import CorpusError, DatasetError, UsageError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

ids = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"), min_size=1, max_size=12).filter(
    lambda s: s.strip() == s and s.strip())
texts = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=60).filter(lambda s: s.strip())


def _records(draw_items):
    seen, out = set(), []
    for pid, title, text in draw_items:
        if pid not in seen:
            seen.add(pid)
            out.append({"id": pid, "title": title.strip(), "text": text.strip()})
    return out


@SETTINGS
@given(st.lists(st.tuples(ids, st.text(max_size=20), texts), min_size=1, max_size=8))
def test_jsonl_round_trips_any_records(tmp_path, items):
    records = _records(items)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    got = [(p.id, p.title, p.text) for p in read_corpus(path)]
    assert got == [(r["id"], r["title"], r["text"]) for r in records]
    record(bad_inputs=0, property_examples=1)


@SETTINGS
@given(st.lists(st.tuples(ids, st.text(max_size=20), texts), min_size=1, max_size=8))
def test_csv_round_trips_any_records(tmp_path, items):
    records = _records(items)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["id", "title", "text"], lineterminator="\n", quoting=csv.QUOTE_ALL)
    writer.writeheader()
    writer.writerows(records)
    path = tmp_path / "c.csv"
    path.write_bytes(buf.getvalue().encode("utf-8"))
    got = [(p.id, p.title, p.text) for p in read_corpus(path)]
    assert got == [(r["id"], r["title"].strip(), r["text"].strip()) for r in records]


@SETTINGS
@given(st.binary(max_size=400), st.sampled_from(["jsonl", "csv", "tsv", "json"]), st.booleans())
def test_any_bytes_give_passages_or_a_corpus_error(tmp_path, data, fmt, skip_bad):
    path = tmp_path / f"c.{fmt}"
    path.write_bytes(data)
    try:
        passages = list(read_corpus(path, skip_bad=skip_bad))
    except CorpusError as exc:
        assert str(path) in exc.message or "stdin" in exc.message
        record(bad_inputs=1)
        return
    assert all(p.id and p.text.strip() and "\0" not in p.id for p in passages)


@SETTINGS
@given(st.binary(max_size=300))
def test_any_questions_file_gives_questions_or_a_usage_error(data):
    from cachegraft_cli.answering.questions import parse_questions

    try:
        items = parse_questions(data, "q.jsonl")
    except UsageError as exc:
        assert exc.message.startswith("q.jsonl")
        record(bad_inputs=1)
        return
    assert items and all(isinstance(q, str) and q.strip() for _, q in items)


@SETTINGS
@given(st.lists(st.tuples(st.one_of(st.text(max_size=8), st.integers(0, 99)), texts), min_size=1, max_size=6))
def test_questions_round_trip(items):
    from cachegraft_cli.answering.questions import parse_questions

    # a NUL is refused in questions and ids (as every text argument: see test_hostile_inputs.py)
    items = [(qid, q) for qid, q in items if "\0" not in f"{qid}{q}"]
    assume(items)
    lines = "".join(json.dumps({"id": qid, "question": q}) + "\n" for qid, q in items)
    assert parse_questions(lines.encode(), "q.jsonl") == [(qid, q) for qid, q in items]


@SETTINGS
@given(st.text(max_size=60))
def test_any_benchmark_spec_parses_or_is_a_usage_error_and_names_stay_plain(text):
    from cachegraft_cli.evaluation.datasets import parse_dataset_spec

    try:
        spec = parse_dataset_spec(text)
    except (UsageError, DatasetError):
        record(bad_inputs=1)
        return
    assert "/" not in spec.name and "\\" not in spec.name and ".." not in spec.name and "\0" not in spec.name


# ---------------------------------------------------------------- codecs and tables

GEOMETRY = {"layers": 2, "kv_heads": 2, "head_dim": 8}


def _cache(seed: int, tokens: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(0, scale, size=(tokens, 2, 2, 2, 8))).astype(np.float32)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(1, 70), st.floats(1e-3, 1e3))
def test_lossless_codecs_round_trip_exactly(seed, tokens, scale):
    from cachegraft_cli.store.codecs import from_bf16_words, get_codec, to_bf16_words

    x = from_bf16_words(to_bf16_words(_cache(seed, tokens, scale)))  # bf16 values, as the encoder makes
    for name in ("bf16", "float32"):
        codec = get_codec(name, GEOMETRY)
        assert np.array_equal(codec.decode(codec.encode(x), 0, tokens), x)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(1, 70), st.floats(1e-2, 1e2))
def test_quantising_codecs_stay_within_half_a_step(seed, tokens, scale):
    from cachegraft_cli.store.codecs import get_codec

    x = _cache(seed, tokens, scale)
    for name in ("int8", "int4"):
        codec = get_codec(name, GEOMETRY)
        y = codec.decode(codec.encode(x), 0, tokens)
        assert y.shape == x.shape and np.isfinite(y).all()
        span = np.abs(x).max() * (2 / 127 if name == "int8" else 2 / 15) + 1e-6
        assert np.abs(y - x).max() <= span  # half a step of the coarsest scale, with float16 rounding


@SETTINGS
@given(st.lists(st.tuples(ids, st.integers(1, 50)), min_size=1, max_size=20, unique_by=lambda t: t[0]))
def test_row_tables_round_trip_through_rows_bin(items):
    from cachegraft_cli.store.rows import PassageRow, build_table, table_from_bin, table_to_bin

    rows, offset = [], 0
    for i, (pid, n) in enumerate(items):
        rows.append(PassageRow(pid, content_hash=f"{i:064x}", tokens=n, offset=offset,
                               parent_id=pid if i % 2 else None, chunk_index=i if i % 2 else None))
        offset += n
    crcs = [{"fused": {"data": (i * 2654435761) % 2**32}} for i in range(len(rows))]
    table = build_table("seg", rows, crcs)
    back = table_from_bin("seg", table_to_bin(table))
    assert back.ids == table.ids and back.parents == table.parents
    for name in ("hashes", "tokens", "offsets", "chunk_index", "crcs"):
        assert np.array_equal(getattr(back, name), getattr(table, name))


@pytest.mark.parametrize("bad", [b"", b"CGROWS1\n", b"CGROWS1\n\x05\x00\x00\x00\x00\x00\x00\x00{bad}",
                                 b"\x80\x04K\x01."])
def test_damaged_rows_bin_is_a_typed_error(bad):
    from cachegraft_cli.errors import StoreCorruptError
    from cachegraft_cli.store.rows import parse_table

    with pytest.raises(StoreCorruptError, match="rows.bin is unreadable"):
        parse_table("seg", "rows.bin", bad)
