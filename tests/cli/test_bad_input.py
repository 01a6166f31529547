"""Bad input, across commands: each case ends in one `error:` line naming the file, line or
option, a non-zero exit code and no traceback, before any model loads and before anything
is written (the files under the workspace are unchanged). Or, with --skip-bad, in a counted skip.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from faults import record

from cachegraft_cli.cli.app import main
from cachegraft_cli.store.target import Target

SQUAD_QA = {"id": "q1", "question": "When?", "answers": [{"text": "1820"}]}
SQUAD_OK = {"data": [{"title": "Harbor", "paragraphs": [{"context": "Harbor town was founded in 1820.",
                                                         "qas": [SQUAD_QA]}]}]}


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
    put("q-harbor.jsonl", json.dumps({"question": "When was Harbor town founded?"}) + "\n")
    put("squad-ok.json", json.dumps(SQUAD_OK))
    bad = json.loads(json.dumps(SQUAD_OK))
    bad["data"][0]["paragraphs"][0]["qas"][0]["answers"] = "1820"
    put("squad-answers-string.json", json.dumps(bad))
    put("qa-question-number.jsonl", json.dumps({"question": 5, "answers": ["x"]}) + "\n")
    (w / "qa-latin1.jsonl").write_bytes(b'{"question": "caf\xe9?", "answers": ["x"]}\n')
    # valid UTF-8 files whose JSON escapes decode to a lone surrogate, which no store or tokenizer takes
    put("q-surrogate.jsonl", '{"question": "ok?"}\n{"question": "bad \\ud800 escape"}\n')
    put("surrogate.jsonl", '{"id": "a", "text": "bad \\udc80 escape"}\n')
    put("listtitle.jsonl", json.dumps({"id": "a", "title": ["x", "y"], "text": "Harbor town."}) + "\n")
    put("nanmeta.jsonl", '{"id": "a", "text": "Harbor town.", "score": NaN}\n')


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
    encode_corpus(read_corpus(w / "good.jsonl"), Target.open(str(w / "store")), session, EncodeOptions())
    shutil.copytree(w / "store", w / "noindex")
    build_store_index(str(w / "store"))
    shutil.copytree(w / "store", w / "nomanifest")
    (w / "nomanifest" / "manifest.json").unlink()
    _pickled_receiver(w, tiny_dirs["receiver"])
    shutil.copytree(w / "store", w / "lostattrs")  # a store whose zarr.json lost its attributes
    root = json.loads((w / "lostattrs" / "zarr.json").read_text())
    (w / "lostattrs" / "zarr.json").write_text(json.dumps({**root, "attributes": {}}))
    return {"w": w, "receiver": str(tiny_dirs["receiver"])}


def _pickled_receiver(w: Path, receiver: Path) -> None:
    """A copy of the receiver whose weights are a pickle (never loaded: it would run code), and a
    store recording that copy as its receiver."""
    shutil.copytree(receiver, w / "pickle-receiver", ignore=shutil.ignore_patterns("*.safetensors"))
    (w / "pickle-receiver" / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": "pickled"}))
    shutil.copytree(w / "store", w / "pickled-store")
    identity = json.loads((w / "pickled-store" / "zarr.json").read_text())
    text = json.dumps(identity).replace(json.dumps(str(receiver))[1:-1], json.dumps(str(w / "pickle-receiver"))[1:-1])
    (w / "pickled-store" / "zarr.json").write_text(text)


def _enc(corpus: str, *extra, store: str = "new-store", receiver: str | None = None):
    return lambda c: ["encode", c["w"] / corpus, "--store", c["w"] / store, "--receiver",
                      c["w"] / receiver if receiver else c["receiver"], *extra]


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
    Case("jsonl-surrogate-escape", _enc("surrogate.jsonl"), 8, "surrogate.jsonl:1: not UTF-8 (passage 'a': field "
         "'text' holds a lone surrogate"),
    Case("jsonl-list-title", _enc("listtitle.jsonl"), 8, "listtitle.jsonl:1: bad title (passage 'a': field 'title' "
         "is a list, not a string)"),
    Case("jsonl-nan-metadata", _enc("nanmeta.jsonl"), 8, "nanmeta.jsonl:1: bad metadata (passage 'a': field 'score' "
         "is nan, not a finite number"),
    Case("stdin-as-csv", lambda c: ["encode", "-", "--store", c["w"] / "new", "--receiver", c["receiver"], "--format",
                                    "csv"], 8, "stdin corpora are JSONL"),
    # options
    Case("encode-codec", _enc("good.jsonl", "--codec", "int5"), 2, "Unknown cache codec 'int5'"),
    Case("encode-tc-no-calibration", _enc("good.jsonl", "--codec", "tc"), 2, "--codec tc needs a calibration"),
    Case("encode-calibration-missing", _enc("good.jsonl", "--codec", "tc", "--calibration", "nope.safetensors"), 2,
         "nope.safetensors' does not exist"),
    Case("encode-calibration-not-one", _enc("good.jsonl", "--codec", "tc", "--calibration", "{w}/good.jsonl"), 2,
         "is not a transform-codec calibration"),
    Case("encode-calibration-without-tc", _enc("good.jsonl", "--calibration", "{w}/good.jsonl"), 2,
         "--calibration is for the transform codec only"),
    Case("store-calibrate-too-few", lambda c: ["store", "calibrate", c["w"] / "store", "--out", c["w"] / "cal.st"], 2,
         "a calibration needs at least 1,000"),
    Case("encode-batch-zero", _enc("good.jsonl", "-b", "0"), 2, "batch_size (--batch-size) must be a whole number"),
    Case("encode-batch-huge", _enc("good.jsonl", "-b", "1000000000"), 2, "from 1 to 4,096; got 1000000000"),
    Case("encode-max-tokens", _enc("good.jsonl", "--max-passage-tokens", "3"), 2, "(--max-passage-tokens)"),
    Case("encode-commit-every", _enc("good.jsonl", "--commit-every", "0"), 2, "(--commit-every)"),
    Case("encode-device-cuda7", _enc("good.jsonl", "--device", "cuda:7"), 2, "device 'cuda:7'"),
    Case("encode-device-bogus", _enc("good.jsonl", "--device", "gpu0"), 2, "unknown device 'gpu0'"),
    Case("encode-dtype", _enc("good.jsonl", "--dtype", "int8"), 2, "unknown dtype 'int8'"),
    Case("encode-preset", lambda c: ["encode", c["w"] / "good.jsonl", "--store", c["w"] / "n", "--preset", "nope"], 2,
         "Unknown preset 'nope'"),
    Case("encode-receiver-pickle", _enc("good.jsonl", store="n", receiver="pickle-receiver"), 3,
         "holds its weights as a pickle (pytorch_model.bin)"),
    Case("ask-receiver-pickle", _ask("Harbor town?", store="pickled-store"), 3,
         "holds its weights as a pickle (pytorch_model.bin)"),
    Case("encode-receiver-missing", lambda c: ["encode", c["w"] / "good.jsonl", "--store", c["w"] / "n", "--receiver",
                                               "./no-such-model"], 3, "'./no-such-model' is not a local directory"),
    Case("fuser-builtin-escape", _enc("good.jsonl", "--fuser", "builtin:../../fusers"), 4, "builtin:../../fusers"),
    Case("fuser-builtin-unknown", _enc("good.jsonl", "--fuser", "builtin:nope"), 4, "No built-in fuser named"),
    Case("fuser-not-a-spec", _enc("good.jsonl", "--fuser", "nofuser"), 4, "'nofuser' is neither a local directory"),
    # paths and stores
    Case("store-is-a-file", _enc("good.jsonl", store="plainfile"), 5, "plainfile is a file"),
    Case("store-foreign-dir", _enc("good.jsonl", store="junkdir"), 5, "junkdir is a directory with other files"),
    Case("store-other-codec", _enc("good.jsonl", "--codec", "bf16", store="store"), 5, "codec='int8'"),
    Case("store-other-compressor", _enc("good.jsonl", "--compressor", "none", store="store"), 5, "compressor='zstd'"),
    Case("encode-bad-compressor", _enc("good.jsonl", "--compressor", "gzip"), 2, "compressor"),
    Case("store-no-own-caches", _enc("good.jsonl", "--also-own-cache", store="store"), 5, "without own caches"),
    Case("store-lost-manifest", _enc("good.jsonl", store="nomanifest"), 7, "manifest.json is missing"),
    # an append with no model option: the store is checked before the default preset is looked up on the hub
    Case("store-lost-attributes", lambda c: ["encode", c["w"] / "good.jsonl", "--store", c["w"] / "lostattrs"], 5,
         "lostattrs is not a cache store: its zarr.json holds no cachegraft metadata"),
    Case("store-other-receiver", _enc("good.jsonl", store="store", receiver="pickle-receiver"), 5,
         "was encoded with receiver"),
    # ask: questions files, options, stores
    Case("ask-question-number", _ask("-q", "{w}/q-number.jsonl"), 2, "q-number.jsonl:1"),
    Case("ask-questions-not-utf8", _ask("-q", "{w}/q-latin1.jsonl"), 2, "q-latin1.jsonl:1: not UTF-8"),
    Case("ask-questions-malformed", _ask("-q", "{w}/q-malformed.jsonl"), 2, "q-malformed.jsonl:2: malformed JSON"),
    Case("ask-questions-missing", _ask("-q", "{w}/q-nope.jsonl"), 2, "Cannot read questions file"),
    Case("ask-questions-empty", _ask("-q", "{w}/q-empty.jsonl"), 2, "no questions"),
    Case("ask-questions-blank", _ask("-q", "{w}/q-blank.jsonl"), 2, "q-blank.jsonl:1: the question is empty"),
    Case("ask-empty-question", _ask("   "), 2, "The question is empty"),
    # bash's $'\xff\xfe': Python's argv holds it surrogate-escaped; refused before the model loads
    Case("ask-not-utf8-argument", _ask("\udcff\udcfe"), 2, "question holds a lone surrogate ('\\udcff', not UTF-8)"),
    Case("ask-questions-surrogate", _ask("-q", "{w}/q-surrogate.jsonl"), 2,
         "q-surrogate.jsonl:2: the question holds a lone surrogate"),
    Case("ask-blend-layer-past-last", _ask("why?", "--blend", "0.5", "--blend-layer", "4"), 2,
         "blend_layer (--blend-layer) must be from 0 to 3: the receiver has 4 layers; got 4"),
    Case("ask-both", _ask("why?", "-q", "{w}/q-number.jsonl"), 2, "either a QUESTION or --questions"),
    Case("ask-index-kind", _ask("why?", "--index-kind", "bogus"), 2, "index_kind (--index-kind) 'bogus'"),
    Case("ask-system", _ask("why?", "--system", "oracle"), 2, "Unknown system 'oracle'"),
    Case("ask-scheme", _ask("why?", "--scheme", "spiral"), 2, "Unknown position scheme 'spiral'"),
    Case("ask-k-zero", _ask("why?", "-k", "0"), 2, "k (-k) must be a whole number of at least 1; got 0"),
    Case("ask-batch-huge", _ask("why?", "-b", "1000000000"), 2, "batch_size (--batch-size)"),
    Case("ask-device", _ask("why?", "--device", "cuda:7"), 2, "device 'cuda:7'"),
    Case("ask-weights", _ask("why?", "--weights", "int3"), 2, "unknown weights 'int3'"),
    Case("ask-weights-off-cpu", _ask("why?", "--weights", "int4", "--device", "cuda"), 2, "device 'cuda'"),
    Case("ask-max-new-tokens-zero", _ask("why?", "--max-new-tokens", "0"), 2, "max_new_tokens (--max-new-tokens)"),
    Case("ask-temperature-negative", _ask("why?", "--temperature", "-1"), 2, "temperature (--temperature)"),
    Case("ask-temperature-tiny", _ask("why?", "--temperature", "1e-9"), 2, "0 (greedy) or at least 0.001"),
    Case("ask-seed-negative", _ask("why?", "--seed", "-1"), 2, "seed (--seed)"),
    Case("ask-recompute-negative", _ask("why?", "--recompute", "-1"), 2, "recompute (--recompute)"),
    Case("ask-blend-above-one", _ask("why?", "--blend", "2"), 2, "blend (--blend) must be a number from 0 to 1"),
    Case("ask-blend-layer", _ask("why?", "--blend-layer", "-1"), 2, "blend_layer (--blend-layer)"),
    Case("ask-batch-zero", _ask("why?", "-b", "0"), 2, "batch_size (--batch-size)"),
    # the context window, from the receiver's config.json before it loads (the tiny receiver has 512)
    Case("ask-max-new-tokens-window", _ask("Harbor town?", "--max-new-tokens", "100000"), 2, "context window of 512"),
    Case("ask-max-new-tokens-window-text", _ask("Harbor town?", "--max-new-tokens", "100000", "--system", "text"), 2,
         "context window of 512"),
    Case("ask-max-new-tokens-window-batch", _ask("-q", "{w}/q-harbor.jsonl", "--max-new-tokens", "600"), 2,
         "context window of 512"),
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
    # the receiver's layers from its config.json: refused before the run encodes its stores
    Case("eval-blend-layer", _eval("x={w}/squad-ok.json", "--blend", "0.5", "--blend-layer", "9"), 2,
         "blend_layer (--blend-layer) must be from 0 to 3"),
    Case("eval-variant-blend-layer", _eval("x={w}/squad-ok.json", "--systems", "text,graft@blend=0.5@blend_layer=4"),
         2, "must be from 0 to 3: the receiver has 4 layers; got 4"),
    Case("eval-query-option", _eval("x={w}/squad-ok.json?color=red"), 2, "Bad dataset option 'color=red'"),
    # fuser
    Case("fuser-info-escape", lambda c: ["fuser", "info", "builtin:../../fusers"], 4, "builtin:../../fusers"),
]


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


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


@pytest.fixture(scope="module")
def long_store(tiny_dirs, tmp_path_factory):
    """40 passages of about 20 tokens each: all of them overflow the tiny receiver's 512 positions."""
    import cachegraft_cli as cg

    path = tmp_path_factory.mktemp("long") / "store"
    words = "harbor lighthouse fishermen founded town river bank treaty signed"
    passages = [{"id": f"p{i}", "title": f"Harbor {i}", "text": f"Harbor town passage {i}: {words} {words}."}
                for i in range(40)]
    cg.encode(passages, path, models=cg.Models(receiver=str(tiny_dirs["receiver"]), dtype="float32"))
    cg.index(path)
    return path


@pytest.mark.parametrize("system", ["graft", "text"])
def test_context_window_is_checked_before_models_load(long_store, system, no_model_loads, capsys, monkeypatch):
    """`-k 100000` retrieves every passage: refused from config.json and the store's rows,
    before the receiver loads, with the message the check after loading gives."""
    before = _snapshot(long_store)
    for args in (["-k", "100000"], ["-k", "30", "--max-new-tokens", "2"], ["--max-new-tokens", "100000"]):
        monkeypatch.setattr(sys, "argv", ["cachegraft", "ask", "harbor lighthouse", "--store", str(long_store),
                                          "--system", system, *args])
        with pytest.raises(SystemExit) as info:
            main()
        err = capsys.readouterr().err
        assert info.value.code == 2 and "context window of 512" in err and "Traceback" not in err, err
        assert "Lower -k" in err
        record(bad_inputs=1)
    assert _snapshot(long_store) == before


def test_context_window_check_before_loading_agrees_with_the_one_after(long_store, tiny_dirs):
    """The planned end position is the built prompt's, for every system and scheme: the check
    before loading refuses exactly what the check after loading refuses."""
    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.api import ask_options

    asker = Asker(long_store)
    cases = (("graft", "rotate", 3, 0), ("graft", "shared", 3, 0), ("graft", "rotate", 3, 4), ("text", "rotate", 3, 0),
             ("closed", "rotate", 1, 0))
    for system, scheme, k, recompute in cases:
        options = ask_options(system=system, scheme=scheme, k=k, recompute=recompute)
        hits = asker.retrieve("harbor lighthouse", k) if system != "closed" else []
        planned = asker.plan("harbor lighthouse", hits, options)
        _, prompt = asker.prompt_of(planned, options)
        assert planned.end == prompt.end_position, (system, scheme)


SAME_MISTAKES = [
    (["-k", "0"], {"k": 0}),
    (["--max-new-tokens", "0"], {"max_new_tokens": 0}),
    (["--temperature", "-1"], {"temperature": -1.0}),
    (["--seed", "-5"], {"seed": -5}),
    (["--recompute", "-1"], {"recompute": -1}),
    (["--blend", "2"], {"blend": 2.0}),
    (["--blend-layer", "-1"], {"blend_layer": -1}),
    (["--scheme", "spiral"], {"scheme": "spiral"}),
    (["--system", "oracle"], {"system": "oracle"}),
    (["-b", "0"], {"batch_size": 0}),
    (["--index-kind", "bogus"], {"index_kind": "bogus"}),
]


@pytest.mark.parametrize("flags, keywords", SAME_MISTAKES, ids=[m[0][0] for m in SAME_MISTAKES])
def test_the_cli_and_the_api_say_the_same_for_the_same_mistake(flags, keywords, workspace, no_model_loads, capsys,
                                                               monkeypatch):
    """One check for both: `ask` with a bad flag and `ask_many` with the bad keyword print the
    same message and hint."""
    import cachegraft_cli as cg
    from cachegraft_cli.errors import UsageError

    store = str(workspace["w"] / "store")
    monkeypatch.setattr(sys, "argv", ["cachegraft", "ask", "why?", "--store", store, *flags])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    kw = dict(keywords)
    opener = {"index_kind": kw.pop("index_kind")} if "index_kind" in kw else {}
    with pytest.raises(UsageError) as api:
        cg.ask_many(["why?"], store, **opener, **kw)
    assert info.value.code == api.value.exit_code == 2
    assert err.splitlines()[:2] == [f"error: {api.value.message}", f"  hint: {api.value.hint}"], err
    record(bad_inputs=2, api_bad_calls=1, api_raw_exceptions=0)


def test_the_bound_before_the_tokenizer_never_exceeds_the_exact_end(long_store):
    """The metadata-only bound is a lower bound of the exact end for every system and scheme, so
    it never refuses a prompt that fits."""
    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.api import ask_options

    asker = Asker(long_store)
    for system in ("graft", "text", "closed"):
        for scheme in ("rotate", "shared"):
            options = ask_options(system=system, scheme=scheme, k=3)
            hits = asker.retrieve("harbor lighthouse", 3) if system != "closed" else []
            plan = asker.plan("harbor lighthouse", hits, options)
            assert asker.least_end(plan.rows, options) <= plan.end, (system, scheme)
