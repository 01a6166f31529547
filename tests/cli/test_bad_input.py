"""Bad input, across commands: each case ends in one `error:` line naming the file, line or
option, a non-zero exit code and no traceback, before any model loads and before anything
is written (the files under the workspace are unchanged). Or, with --skip-bad, in a counted skip.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from faults import record

from cachegraft_cli.cli.app import main

SQUAD_OK = {"data": [{"title": "Harbor", "paragraphs": [{
    "context": "Harbor town was founded in 1820.",
    "qas": [{"id": "q1", "question": "When?", "answers": [{"text": "1820"}]}]}]}]}


@dataclass(frozen=True)
class Case:
    name: str
    args: Callable[[dict], list]
    code: int
    text: str  # the error line names this (file, line or option)


def _files(w: Path) -> None:
    """Every bad input file, written once."""
    def put(name: str, data) -> None:
        path = w / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())

    good = json.dumps({"id": "a", "title": "T", "text": "Harbor town was founded in 1820."}) + "\n"
    put("good.jsonl", good)
    put("malformed.jsonl", good + '{"id": "b", "text": "unterminated\n')
    put("array.jsonl", '["not", "an", "object"]\n')
    put("notext.jsonl", json.dumps({"id": "a", "title": "T"}) + "\n")
    put("numtext.jsonl", json.dumps({"id": "a", "text": 42}) + "\n")
    put("latin1.jsonl", good + '{"id": "b", "text": "caf\xe9"}\n'.encode("latin-1").decode("latin-1"))
    (w / "latin1.jsonl").write_bytes(good.encode() + b'{"id": "b", "text": "caf\xe9"}\n')
    put("nulid.jsonl", json.dumps({"id": "a\u0000b", "text": "x y z"}) + "\n")
    put("dupid.jsonl", good + json.dumps({"id": "a", "title": "T", "text": "Other text."}) + "\n")
    put("empty.jsonl", "")
    put("allbad.jsonl", "{bad\n[1]\n")
    put("noid.jsonl", json.dumps({"text": "no doc id here"}) + "\n")
    put("nocol.csv", "id,body\n1,hello\n")
    put("badrow.csv", "id,text\n1,hello\n2,too,many,fields\n")
    (w / "badheader.csv").write_bytes(b"id,t\xffext\n1,hello\n")
    put("emptytext.tsv", "id\ttext\n1\t   \n")
    put("malformed.json", '{"data": [ {"title": "x", ')
    put("neither.json", '{"rows": []}')
    put("nocontext.json", json.dumps({"data": [{"title": "A", "paragraphs": [{"qas": []}]}]}))
    put("listitem.json", json.dumps(["just a string"]))
    put("corpus.txt2", "text")
    (w / "nodocs").mkdir()
    put("nodocs/readme.pdf", "x")
    (w / "badmd").mkdir()
    (w / "badmd/a.md").write_bytes(b"# Title\nbad \xff byte\n")
    put("plainfile", "not a store")
    put("junkdir/notes.txt", "my own files")
    put("q-number.jsonl", json.dumps({"id": "q1", "question": 123}) + "\n")
    (w / "q-latin1.jsonl").write_bytes(b'{"question": "caf\xe9?"}\n')
    put("q-malformed.jsonl", '{"question": "ok?"}\n{"question": \n')
    put("q-empty.jsonl", "\n\n")
    put("q-blank.jsonl", json.dumps({"question": "   "}) + "\n")
    put("squad-ok.json", json.dumps(SQUAD_OK))
    bad = json.loads(json.dumps(SQUAD_OK))
    bad["data"][0]["paragraphs"][0]["qas"][0]["answers"] = "1820"
    put("squad-answers-string.json", json.dumps(bad))
    put("qa-question-number.jsonl", json.dumps({"question": 5, "answers": ["x"]}) + "\n")
    (w / "qa-latin1.jsonl").write_bytes(b'{"question": "caf\xe9?", "answers": ["x"]}\n')


@pytest.fixture(scope="module")
def workspace(tiny_dirs, tmp_path_factory):
    """Files and stores the cases point at; a good store (bf16, indexed) and damaged copies."""
    from cachegraft_cli.corpus import read_corpus
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.session import ModelChoice, ModelSession

    w = tmp_path_factory.mktemp("bad-input")
    _files(w)
    session = ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32"))
    encode_corpus(read_corpus(w / "good.jsonl"), str(w / "store"), session, EncodeOptions())
    shutil.copytree(w / "store", w / "noindex")
    build_store_index(str(w / "store"))
    shutil.copytree(w / "store", w / "nomanifest")
    (w / "nomanifest" / "manifest.json").unlink()
    return {"w": w, "receiver": str(tiny_dirs["receiver"])}


def _enc(corpus: str, *extra, store: str = "new-store"):
    return lambda c: ["encode", c["w"] / corpus, "--store", c["w"] / store, "--receiver", c["receiver"], *extra]


def _ask(*extra, store: str = "store"):
    return lambda c: ["ask", *extra, "--store", c["w"] / store]


def _eval(bench: str, *extra):
    return lambda c: ["evaluate", "-B", bench.format(w=c["w"]), "--out", c["w"] / "run", "--stores", c["w"] / "stores",
                      "--receiver", c["receiver"], *extra]


CASES = [
    # corpus files: JSONL, CSV/TSV, SQuAD JSON, directories, stdin
    Case("corpus-missing", _enc("nope.jsonl"), 8, "nope.jsonl: no such file"),
    Case("corpus-extension", _enc("corpus.txt2"), 8, "cannot tell the corpus format"),
    Case("corpus-format-option", _enc("good.jsonl", "--format", "xml"), 8, "unknown corpus format 'xml'"),
    Case("jsonl-malformed", _enc("malformed.jsonl"), 8, "malformed.jsonl:2: malformed JSON"),
    Case("jsonl-array", _enc("array.jsonl"), 8, "array.jsonl:1: not an object"),
    Case("jsonl-no-text", _enc("notext.jsonl"), 8, "notext.jsonl:1: missing text"),
    Case("jsonl-number-text", _enc("numtext.jsonl"), 8, "numtext.jsonl:1: missing text"),
    Case("jsonl-not-utf8", _enc("latin1.jsonl"), 8, "latin1.jsonl:2: not UTF-8"),
    Case("jsonl-nul-id", _enc("nulid.jsonl"), 8, "nulid.jsonl:1: bad id"),
    Case("jsonl-duplicate-id", _enc("dupid.jsonl"), 8, "dupid.jsonl:2: duplicate id"),
    Case("jsonl-empty", _enc("empty.jsonl"), 8, "empty.jsonl: the corpus holds no passages"),
    Case("jsonl-all-bad-skipped", _enc("allbad.jsonl", "--skip-bad"), 8, "allbad.jsonl: every record was bad"),
    Case("jsonl-id-field-missing", _enc("noid.jsonl", "--id-field", "doc_id"), 8, "noid.jsonl:1: missing id"),
    Case("csv-no-text-column", _enc("nocol.csv"), 8, "nocol.csv: no column 'text'"),
    Case("csv-bad-row", _enc("badrow.csv"), 8, "badrow.csv:3: bad row"),
    Case("csv-header-not-utf8", _enc("badheader.csv"), 8, "badheader.csv:1: not UTF-8"),
    Case("tsv-empty-text", _enc("emptytext.tsv"), 8, "emptytext.tsv:2: missing text"),
    Case("json-malformed", _enc("malformed.json"), 8, "malformed.json:1: malformed JSON"),
    Case("json-neither", _enc("neither.json"), 8, "neither.json: not a SQuAD file"),
    Case("squad-no-context", _enc("nocontext.json"), 8, "data[0].paragraphs[0]: missing text"),
    Case("json-list-item", _enc("listitem.json"), 8, "listitem.json: [0]: not an object"),
    Case("dir-no-text-files", _enc("nodocs"), 8, "nodocs: no readable .txt or .md file"),
    Case("dir-not-utf8", _enc("badmd"), 8, "a.md:2: not UTF-8"),
    Case("dir-with-jsonl-format", _enc("badmd", "--format", "jsonl"), 8, "is a directory"),
    Case("stdin-as-csv", lambda c: ["encode", "-", "--store", c["w"] / "new", "--receiver", c["receiver"], "--format",
                                    "csv"], 8, "stdin corpora are JSONL"),
    # options
    Case("encode-codec", _enc("good.jsonl", "--codec", "int5"), 2, "unknown cache codec 'int5'"),
    Case("encode-batch-zero", _enc("good.jsonl", "-b", "0"), 2, "'--batch-size'"),
    Case("encode-batch-huge", _enc("good.jsonl", "-b", "1000000000"), 2, "'--batch-size'"),
    Case("encode-max-tokens", _enc("good.jsonl", "--max-passage-tokens", "3"), 2, "'--max-passage-tokens'"),
    Case("encode-commit-every", _enc("good.jsonl", "--commit-every", "0"), 2, "'--commit-every'"),
    Case("encode-device-cuda7", _enc("good.jsonl", "--device", "cuda:7"), 2, "device 'cuda:7'"),
    Case("encode-device-bogus", _enc("good.jsonl", "--device", "gpu0"), 2, "unknown device 'gpu0'"),
    Case("encode-dtype", _enc("good.jsonl", "--dtype", "int8"), 2, "unknown dtype 'int8'"),
    Case("encode-preset", lambda c: ["encode", c["w"] / "good.jsonl", "--store", c["w"] / "n", "--preset", "nope"], 2,
         "Unknown preset 'nope'"),
    Case("encode-receiver-missing", lambda c: ["encode", c["w"] / "good.jsonl", "--store", c["w"] / "n", "--receiver",
                                               "./no-such-model"], 3, "'./no-such-model' is not a local directory"),
    Case("fuser-builtin-escape", _enc("good.jsonl", "--fuser", "builtin:../../fusers"), 4, "builtin:../../fusers"),
    Case("fuser-builtin-unknown", _enc("good.jsonl", "--fuser", "builtin:nope"), 4, "No built-in fuser named"),
    Case("fuser-not-a-spec", _enc("good.jsonl", "--fuser", "nofuser"), 4, "'nofuser' is neither a local directory"),
    # paths and stores
    Case("store-is-a-file", _enc("good.jsonl", store="plainfile"), 5, "plainfile is a file"),
    Case("store-foreign-dir", _enc("good.jsonl", store="junkdir"), 5, "junkdir is a directory with other files"),
    Case("store-other-codec", _enc("good.jsonl", "--codec", "int8", store="store"), 5, "codec='bf16'"),
    Case("store-no-own-caches", _enc("good.jsonl", "--also-own-cache", store="store"), 5, "without own caches"),
    Case("store-lost-manifest", _enc("good.jsonl", store="nomanifest"), 7, "manifest.json is missing"),
    # ask: questions files, options, stores
    Case("ask-question-number", _ask("-q", "{w}/q-number.jsonl"), 2, "q-number.jsonl:1"),
    Case("ask-questions-not-utf8", _ask("-q", "{w}/q-latin1.jsonl"), 2, "q-latin1.jsonl:1: not UTF-8"),
    Case("ask-questions-malformed", _ask("-q", "{w}/q-malformed.jsonl"), 2, "q-malformed.jsonl:2: malformed JSON"),
    Case("ask-questions-missing", _ask("-q", "{w}/q-nope.jsonl"), 2, "Cannot read questions file"),
    Case("ask-questions-empty", _ask("-q", "{w}/q-empty.jsonl"), 2, "no questions"),
    Case("ask-questions-blank", _ask("-q", "{w}/q-blank.jsonl"), 2, "q-blank.jsonl:1: the question is empty"),
    Case("ask-empty-question", _ask("   "), 2, "The question is empty"),
    Case("ask-both", _ask("why?", "-q", "{w}/q-number.jsonl"), 2, "either a QUESTION or --questions"),
    Case("ask-index-kind", _ask("why?", "--index-kind", "bogus"), 2, "--index-kind 'bogus'"),
    Case("ask-system", _ask("why?", "--system", "oracle"), 2, "Unknown system 'oracle'"),
    Case("ask-scheme", _ask("why?", "--scheme", "spiral"), 2, "Unknown position scheme 'spiral'"),
    Case("ask-k-zero", _ask("why?", "-k", "0"), 2, "'-k'"),
    Case("ask-batch-huge", _ask("why?", "-b", "1000000000"), 2, "'--batch-size'"),
    Case("ask-device", _ask("why?", "--device", "cuda:7"), 2, "device 'cuda:7'"),
    Case("ask-store-file", _ask("why?", store="plainfile"), 5, "plainfile is not a cache store"),
    Case("ask-store-missing", _ask("why?", store="nowhere"), 5, "no cache store at"),
    Case("ask-no-index", _ask("why?", store="noindex"), 9, "no retrieval index"),
    Case("ask-lost-manifest", _ask("why?", store="nomanifest"), 7, "manifest.json is missing"),
    # store, index
    Case("verify-file", lambda c: ["store", "verify", c["w"] / "plainfile"], 5, "plainfile is not a cache store"),
    Case("verify-reencode-alone", lambda c: ["store", "verify", c["w"] / "store", "--reencode"], 2, "--reencode"),
    Case("info-missing", lambda c: ["store", "info", c["w"] / "nowhere"], 5, "no cache store at"),
    Case("unlock-missing", lambda c: ["store", "unlock", c["w"] / "nowhere"], 5, "no cache store at"),
    Case("index-kind", lambda c: ["index", "--store", c["w"] / "store", "--kind", "bogus"], 2,
         "unknown index kind 'bogus'"),
    Case("index-file", lambda c: ["index", "--store", c["w"] / "plainfile"], 5, "plainfile is not a cache store"),
    Case("index-missing", lambda c: ["index", "--store", c["w"] / "nowhere"], 5, "no cache store at"),
    # evaluate: QA files and options
    Case("eval-name-escape", _eval("../escaped={w}/squad-ok.json"), 2, "Bad benchmark name '../escaped'"),
    Case("eval-missing-file", _eval("x={w}/nope.json"), 11, "nope.json"),
    Case("eval-answers-string", _eval("x={w}/squad-answers-string.json"), 11, "\"answers\" must be a list"),
    Case("eval-question-number", _eval("x={w}/qa-question-number.jsonl"), 11, "row 1: 'question' must be a string"),
    Case("eval-not-utf8", _eval("x={w}/qa-latin1.jsonl"), 11, "qa-latin1.jsonl:1: not UTF-8"),
    Case("eval-systems", _eval("x={w}/squad-ok.json", "--systems", "graft,oracle"), 2, "Unknown system 'oracle'"),
    Case("eval-ks", _eval("x={w}/squad-ok.json", "--k", "1,two"), 2, "--k takes a comma list"),
    Case("eval-device", _eval("x={w}/squad-ok.json", "--device", "cuda:7"), 2, "device 'cuda:7'"),
    Case("eval-query-option", _eval("x={w}/squad-ok.json?color=red"), 2, "Bad dataset option 'color=red'"),
    # fuser
    Case("fuser-info-escape", lambda c: ["fuser", "info", "builtin:../../fusers"], 4, "builtin:../../fusers"),
]


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model, fuser or embedder load fails the test: every check must come first."""
    from cachegraft_cli import fuser
    from cachegraft_cli.lm import models
    from cachegraft_cli.retrieval import index as retrieval

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    for module, name in ((models, "load_causal_lm"), (fuser, "load_fuser"), (retrieval, "load_embedder")):
        monkeypatch.setattr(module, name, refuse)


def _args(case: Case, ctx: dict) -> list[str]:
    return [str(a).format(w=ctx["w"]) for a in case.args(ctx)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_fails_cleanly_before_models_load(case, workspace, no_model_loads, capsys, monkeypatch):
    w = workspace["w"]
    before = _snapshot(w)
    monkeypatch.setattr(sys, "argv", ["cachegraft", *_args(case, workspace)])
    monkeypatch.setattr(sys, "stdin", io.StringIO((w / "good.jsonl").read_text()))
    capsys.readouterr()
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        main()
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and "this is a bug" not in err, err
    assert info.value.code == case.code, err
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and case.text in errors[0], err
    assert all(line.startswith(("error: ", "  hint: ", "note: ")) for line in lines), err
    assert _snapshot(w) == before  # nothing written, nothing touched
    record(bad_inputs=1, max_bad_input_seconds=round(seconds, 3))


def test_at_least_forty_cases_cover_every_command():
    assert len(CASES) >= 40
    commands = {c.name.split("-")[0] for c in CASES}
    assert {"corpus", "jsonl", "csv", "json", "dir", "encode", "store", "ask", "eval", "index", "verify"} <= commands


def test_skip_bad_counts_what_it_skipped(workspace, tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "mixed.jsonl"
    good = [json.dumps({"id": f"g{i}", "text": f"good passage {i}"}) for i in range(3)]
    corpus.write_text("\n".join([good[0], "{broken", good[1], '["x"]', json.dumps({"id": "n"}), good[2]]) + "\n")
    monkeypatch.setattr(sys, "argv", ["cachegraft", "encode", str(corpus), "--store", str(tmp_path / "s"), "--receiver",
                                      workspace["receiver"], "--dtype", "float32", "--skip-bad", "--json"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main()
    out, err = capsys.readouterr()
    assert info.value.code == 0, err
    summary = json.loads(out)
    assert summary["added"] == 3 and summary["skipped_bad"] == 3
    assert summary["skipped_reasons"] == {"malformed JSON": 1, "not an object": 1, "missing text": 1}
    record(bad_inputs=3)
