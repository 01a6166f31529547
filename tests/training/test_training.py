"""Fuser training on the tiny models: learning, exact caches, checkpoints, resume, adapter."""

import json

import pytest
import torch

from cachegraft_cli.errors import TrainingError
from cachegraft_cli.fuser.checkpoint import load_checkpoint, save_published
from cachegraft_cli.fuser.fusion import PassageFusion
from cachegraft_cli.lm import kvcache
from cachegraft_cli.lm.template import PromptTemplate
from cachegraft_cli.training import TrainConfig, fusermodel, objectives
from cachegraft_cli.training.data import QAPair
from cachegraft_cli.training.loop import run
from cachegraft_cli.training.precompute import CacheBank, bank_identity

PASSAGES = [
    ("Harbor", "Harbor town was founded in 1820 by fishermen who built the first lighthouse."),
    ("Treaty", "The treaty was signed in Vienna after long talks between the two empires."),
    ("", "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen."),
    ("Fox", "The quick brown fox jumps over the lazy dog near the river bank."),
]
QUESTIONS = [
    (0, "who built the lighthouse?", "fishermen"), (0, "when was Harbor town founded?", "1820"),
    (1, "where was the treaty signed?", "Vienna"), (1, "who talked?", "the two empires"),
    (2, "what does photosynthesis make?", "sugar and oxygen"), (3, "who jumps?", "the quick brown fox"),
]


@pytest.fixture(scope="module")
def squad_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train_qa.json"
    paragraphs = [
        {"context": text, "qas": [{"id": f"q{j}", "question": q, "answers": [{"text": a, "answer_start": 0}]}
                                  for j, (i, q, a) in enumerate(QUESTIONS) if i == n]}
        for n, (_, text) in enumerate(PASSAGES)
    ]
    path.write_text(json.dumps({"data": [{"title": "Tiny", "paragraphs": paragraphs}]}))
    return path


def _setup(r, s, sharer_input="model", hidden=16):
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    cfg = TrainConfig(receiver=r.spec, sharer=s.spec, data=["x"], out="x", hidden_dim=hidden, intermediate_dim=hidden,
                      dropout=0.0, sharer_input=sharer_input)
    torch.manual_seed(0)
    fuser = fusermodel.create(r, s.spec, s.geometry, cfg, anneal_steps=50)
    engine = PassageFusion(r, tpl.prefix_ids(), s, fuser)
    ids = {f"p{n}": tpl.passage_ids(t, x) for n, (t, x) in enumerate(PASSAGES)}
    bank = CacheBank(bank_identity(r, s if sharer_input == "model" else None, tpl, "float32"), "float32")
    bank.fill(engine, ids, batch_size=3)
    prefix = kvcache.batched(engine.prefix_kv())
    qs = [QAPair(f"p{i}", q, a) for i, q, a in QUESTIONS]
    items = objectives.qa_items(qs, tpl, {k: len(v) for k, v in ids.items()}, 16)
    return tpl, fuser, engine, ids, bank, prefix, items


@pytest.mark.parametrize("role", ["sharer_same", "sharer_other"])
def test_precomputed_caches_equal_encode(tiny_models, role):
    r, s = tiny_models["receiver"], tiny_models[role]
    tpl, fuser, engine, ids, bank, prefix, _ = _setup(r, s)
    fuser.set_gates(1.0)
    with torch.no_grad():
        torch.nn.init.normal_(fuser.projectors[0].key_proj_out.weight, std=0.5)
    fuser.eval()
    encoded = engine.fuse(list(ids.values()))  # what `cachegraft encode` stores
    for key, enc in zip(ids, encoded):
        own, sharer = bank.get(key)
        # equal up to float noise from different batch compositions (encode batches differ too)
        assert torch.allclose(own, torch.stack([torch.stack(p) for p in enc.own]), atol=1e-5)
        fused = fuser.fuse(kvcache.batched(list(zip(own[:, 0], own[:, 1]))),
                           kvcache.batched(list(zip(sharer[:, 0], sharer[:, 1]))))
        for (k, v), (ek, ev) in zip(kvcache.unbatched(fused), enc.fused):
            assert torch.allclose(k, ek, atol=1e-5) and torch.allclose(v, ev, atol=1e-5)


def test_batched_loss_equals_text_prompt(tiny_models):
    """Padded, bucketed batch == each item alone == the receiver reading the whole prompt as text."""
    r = tiny_models["receiver"]
    tpl, _, _, ids, bank, prefix, items = _setup(r, tiny_models["sharer_same"])
    with torch.no_grad():
        total, n = objectives.batch_nll(r, None, bank, prefix, items)
        singles = [objectives.batch_nll(r, None, bank, prefix, [i]) for i in items]
        assert n == sum(c for _, c in singles)
        assert abs(float(total) - sum(float(x) for x, _ in singles)) < 1e-3
        item = items[2]
        full = tpl.prefix_ids() + ids[item.passage] + list(item.ids)
        logits = r.model(input_ids=torch.tensor([full])).logits[0]
        start = len(full) - len(item.ids)
        nll = torch.nn.functional.cross_entropy(logits[start + item.n_context - 1 : -1],
                                                torch.tensor(item.ids[item.n_context :]), reduction="sum")
        assert abs(float(nll) - float(singles[2][0])) < 1e-3


def test_steps_reduce_loss_and_reach_gates(tiny_models):
    r = tiny_models["receiver"]
    _, fuser, _, _, bank, prefix, items = _setup(r, tiny_models["sharer_same"])
    batch = items[:4]
    opt = torch.optim.Adam([{"params": fusermodel.other_parameters(fuser), "lr": 1e-2},
                            {"params": fusermodel.gate_parameters(fuser), "lr": 5e-2}])
    losses, gate_grads = [], []
    torch.manual_seed(1)
    for step in range(8):
        fuser.train()
        fusermodel.set_temperature(fuser, step)
        loss, n = objectives.batch_nll(r, fuser, bank, prefix, batch)
        opt.zero_grad()
        (loss / n).backward()
        gate_grads.append(sum(abs(float(p.grad)) for p in fusermodel.gate_parameters(fuser)))
        opt.step()
        losses.append((loss / n).item())
    fuser.eval()
    with torch.no_grad():
        final = objectives.batch_nll(r, fuser, bank, prefix, batch)
    assert losses[-1] < losses[0] - 0.05
    assert gate_grads[0] == 0.0  # zero-initialised proj_out: step 0 is exactly the receiver's cache
    assert max(gate_grads[1:]) > 0.0
    assert all(p.grad is None for p in r.model.parameters())  # the receiver stays frozen
    assert float(final[0] / final[1]) < losses[0]  # eval mode (hard gates) also improved


def test_zero_init_starts_at_receiver_cache(tiny_models):
    r = tiny_models["receiver"]
    _, fuser, _, _, bank, prefix, items = _setup(r, tiny_models["sharer_same"])
    fuser.train()
    with torch.no_grad():
        a = objectives.batch_nll(r, fuser, bank, prefix, items)[0]
        b = objectives.batch_nll(r, None, bank, prefix, items)[0]
    assert torch.allclose(a, b, atol=1e-5)


def test_folded_input_scales_compute_the_same_function(tiny_models, tmp_path):
    r, s = tiny_models["receiver"], tiny_models["sharer_other"]
    _, fuser, _, ids, bank, prefix, items = _setup(r, s)
    fusermodel.add_input_scales(fuser, bank.input_scales(list(ids), fuser.spec.layer_map))
    with torch.no_grad():
        for p in fuser.projectors:
            torch.nn.init.normal_(p.key_proj_out.weight, std=0.3)
            torch.nn.init.normal_(p.value_proj_out.weight, std=0.3)
    fuser.set_gates(2.0)
    fuser.eval()
    folded = fusermodel.fold(fuser)
    assert not any("parametrizations" in k for k in folded.state_dict())
    save_published(folded, tmp_path / "pub")
    reloaded = load_checkpoint(tmp_path / "pub")  # strict: the published architecture exactly
    with torch.no_grad():
        want = objectives.batch_nll(r, fuser, bank, prefix, items)[0]
        for f in (folded, reloaded):
            assert torch.allclose(objectives.batch_nll(r, f, bank, prefix, items)[0], want, atol=1e-4)


def _config(tiny_dirs, squad_file, out, **kw):
    base = dict(receiver=str(tiny_dirs["receiver"]), sharer=str(tiny_dirs["sharer_same"]), data=[str(squad_file)],
                out=str(out), hidden_dim=16, intermediate_dim=16, batch_size=2, max_steps=4, val_every=2,
                save_every=2, val_fraction=0.25, cache_dir="none", cache_dtype="float32", lr=1e-2, gate_lr=0.1,
                warmup_steps=1, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def test_run_saves_a_loadable_fuser_that_reproduces_training(tiny_dirs, tiny_models, squad_file, tmp_path):
    summary = run(_config(tiny_dirs, squad_file, tmp_path / "run", also_published=True), progress=False)
    out = tmp_path / "run"
    assert summary["steps"] == 4 and summary["status"] == "completed"
    for name in ("fuser.json", "fuser.safetensors", "summary.json", "train_log.jsonl"):
        assert (out / name).is_file()
    events = [json.loads(x)["event"] for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert events.count("step") == 4 and "validation" in events and events[-1] == "end"
    assert len(summary["gates"]["gate_states"]) == 4
    own, published = load_checkpoint(out), load_checkpoint(out / "published")
    # the shipped fuser's validation NLL, recomputed from the saved checkpoints, matches the training log
    r, s = tiny_models["receiver"], tiny_models["sharer_same"]
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    engine = PassageFusion(r, tpl.prefix_ids(), s, own)
    from cachegraft_cli.training.data import read_files
    from cachegraft_cli.training.setup import build_items, cap_items, select_passages
    cfg = _config(tiny_dirs, squad_file, tmp_path / "run")
    ds = read_files(cfg.data)
    ids, _, val_keys = select_passages(cfg, tpl, ds, None)
    val = cap_items(build_items(cfg, tpl, ids, val_keys, ds.questions, ds.passages), cfg.max_val_items, cfg.seed)
    bank = CacheBank(bank_identity(r, s, tpl, "float32"), "float32")
    bank.fill(engine, {k: ids[k] for k in val_keys})
    prefix = kvcache.batched(engine.prefix_kv())
    from cachegraft_cli.training.loop import evaluate
    for f in (own, published):
        nll = evaluate(r, f, bank, prefix, val, cfg.batch_size, False)
        assert abs(nll - summary["best_val_nll"]) < 1e-4


def test_weak_gates_are_flipped_and_measured(tiny_dirs, squad_file, tmp_path):
    # a huge threshold makes every gate "weak": the report measures what flipping them all does
    summary = run(_config(tiny_dirs, squad_file, tmp_path / "run", gate_warn_threshold=1e9), progress=False)
    flip = summary["gates"]["weak_flip"]
    assert flip["weak_gates"] == summary["gates"]["total"] == 8
    assert abs(flip["val_nll"] - summary["best_val_nll"]) < 1e-4  # the shipped fuser, as saved
    assert abs(flip["flipped_val_nll"] - flip["val_nll"]) > 1e-6
    assert "Flipping all of them" in summary["gates"]["warnings"][0]


def test_resume_matches_uninterrupted(tiny_dirs, squad_file, tmp_path):
    full = run(_config(tiny_dirs, squad_file, tmp_path / "a"), progress=False)

    def stop(step):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(_config(tiny_dirs, squad_file, tmp_path / "b"), progress=False, on_step=stop)
    state = json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())
    assert state["state"]["step"] == 2
    with pytest.raises(TrainingError):
        run(_config(tiny_dirs, squad_file, tmp_path / "b"), progress=False)  # refuses to overwrite without --resume
    resumed = run(_config(tiny_dirs, squad_file, tmp_path / "b", resume=True), progress=False)
    assert resumed["steps"] == 4
    a, b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    for (k, x), (_, y) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
        assert torch.allclose(x, y, atol=1e-6), k
    assert abs(full["best_val_nll"] - resumed["best_val_nll"]) < 1e-6


def test_adapter_runs_without_sharer(tiny_dirs, tiny_models, squad_file, tmp_path, monkeypatch):
    import cachegraft_cli.lm.models as models

    real = models.load_causal_lm

    def guarded(spec, **kw):
        assert spec != str(tiny_dirs["sharer_other"]), "the adapter must not load the sharer"
        return real(spec, **kw)

    monkeypatch.setattr(models, "load_causal_lm", guarded)
    cfg = _config(tiny_dirs, squad_file, tmp_path / "ad", sharer=str(tiny_dirs["sharer_other"]),
                  sharer_input="zero", max_steps=2)
    summary = run(cfg, progress=False)
    assert summary["steps"] == 2
    fuser = load_checkpoint(tmp_path / "ad")
    assert fuser.spec.sharer_input == "zero"
    save_published(fuser, tmp_path / "ad_pub")
    assert load_checkpoint(tmp_path / "ad_pub").spec.sharer_input == "zero"
    fuser.set_gates(1.0)
    r = tiny_models["receiver"]
    engine = PassageFusion(r, PromptTemplate.for_tokenizer(r.tokenizer).prefix_ids(), None, fuser)
    assert engine.sharer is None and engine.zero_sharer
    out = engine.fuse([[5, 6, 7], [8, 9]])
    assert out[0].fused[0][0].shape == out[0].own[0][0].shape


def test_refuses_the_evaluation_set(tiny_dirs, tmp_path):
    bad = tmp_path / "squad_v1.1_dev.json"
    bad.write_text("{}")
    with pytest.raises(TrainingError, match="evaluation set"):
        run(_config(tiny_dirs, bad, tmp_path / "x"), progress=False)


def test_cli_train_fuser(tiny_dirs, squad_file, tmp_path):
    from typer.testing import CliRunner

    from cachegraft_cli.cli.app import app

    res = CliRunner().invoke(app, [
        "train-fuser", "--receiver", str(tiny_dirs["receiver"]), "--sharer", str(tiny_dirs["sharer_other"]),
        "--data", str(squad_file), "--out", str(tmp_path / "cli"), "--hidden-dim", "8", "--intermediate-dim", "8",
        "--max-steps", "2", "--batch-size", "2", "--cache-dir", "none", "--quiet", "--json",
    ])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["steps"] == 2
    assert load_checkpoint(tmp_path / "cli").spec.alignment is True  # different tokenizers


def test_lm_objective_on_plain_text(tiny_dirs, tmp_path):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"title": t, "text": x}) + "\n" for t, x in PASSAGES))
    summary = run(_config(tiny_dirs, texts, tmp_path / "lm", objective="lm", max_steps=2), progress=False)
    assert summary["steps"] == 2 and summary["data"]["train_items"] >= 2
    assert summary["closed_val_nll"] > 0


def test_multi_passage_items_are_assembled_as_ask_assembles_them(tiny_models):
    """Past of an item with 3 passages == prefix + each passage as encode fuses it, keys re-rotated
    by its offset (the `rotate` scheme of `ask`); padding in a mixed batch changes nothing."""
    r, s = tiny_models["receiver"], tiny_models["sharer_same"]
    tpl, fuser, engine, ids, bank, prefix, items = _setup(r, s)
    fuser.set_gates(1.0)
    with torch.no_grad():
        torch.nn.init.normal_(fuser.projectors[0].key_proj_out.weight, std=0.5)
    fuser.eval()
    lengths = {k: len(v) for k, v in ids.items()}
    multi = objectives.with_passages(items, list(ids), lengths, [3], seed=5)
    item = multi[0]
    assert len(item.parts) == 3 and item.passage in dict(item.parts)
    assert item.past_tokens == sum(n for _, n in item.parts)
    assert multi == objectives.with_passages(items, list(ids), lengths, [3], seed=5)
    rotator = kvcache.KeyRotator.for_model(r.model)
    with torch.no_grad():
        past, got_lengths = objectives.fused_past(fuser, bank, prefix, [item], False, rotator)
        encoded = engine.fuse([ids[k] for k, _ in item.parts])
    pieces, offset = [kvcache.unbatched(prefix)], 0
    for enc, (_, n) in zip(encoded, item.parts):
        pieces.append(rotator.rotate(enc.fused, offset))
        offset += n
    want = kvcache.concat_tokens(pieces)
    assert got_lengths == [item.past_tokens]
    for (k, v), (wk, wv) in zip(kvcache.unbatched(past), want):
        assert torch.allclose(k, wk, atol=1e-5) and torch.allclose(v, wv, atol=1e-5)
    with torch.no_grad():
        batch = [multi[0], items[3], multi[4]]
        total, n = objectives.batch_nll(r, fuser, bank, prefix, batch)
        singles = [objectives.batch_nll(r, fuser, bank, prefix, [i]) for i in batch]
    assert n == sum(c for _, c in singles) and abs(float(total) - sum(float(x) for x, _ in singles)) < 1e-3


def test_passages_per_item_trains_and_is_checked(tiny_dirs, squad_file, tmp_path):
    summary = run(_config(tiny_dirs, squad_file, tmp_path / "k3", passages_per_item=3), progress=False)
    assert summary["status"] == "completed" and summary["steps"] == 4
    with pytest.raises(TrainingError, match="passages-per-item"):
        _config(tiny_dirs, squad_file, tmp_path / "x", passages_per_item=[1, 2], objective="lm").check()


def test_training_nll_with_order_and_recompute_equals_the_ask_path(tiny_models):
    """An item's NLL in training (fused past + recomputed boundary tokens + question/answer, one pass)
    equals the NLL of the same tokens read through ask's assembly (`Assembler.prompt`), and a mixed
    batch (k = 1 and 3, with and without recompute) equals its items one at a time."""
    from cachegraft_cli.answering.assembly import Assembler, AssemblyOptions
    from cachegraft_cli.lm.generation import prompt_logits

    r, s = tiny_models["receiver"], tiny_models["sharer_same"]
    tpl, fuser, engine, ids, bank, prefix, items = _setup(r, s)
    fuser.set_gates(1.0)
    with torch.no_grad():
        torch.nn.init.normal_(fuser.projectors[0].key_proj_out.weight, std=0.5)
    fuser.eval()
    lengths = {k: len(v) for k, v in ids.items()}
    multi = objectives.with_recompute(objectives.with_passages(items, list(ids), lengths, [3], seed=2), ids, 3)
    item = multi[0]
    assert len(item.recompute) == 6 and all(ids[k][j] == t for (o, t), (k, j) in zip(
        item.recompute, [(item.parts[1][0], j) for j in range(3)] + [(item.parts[2][0], j) for j in range(3)]))
    with torch.no_grad():
        train_nll, count = objectives.batch_nll(r, fuser, bank, prefix, [item])
        arrays = [kvcache.to_token_major(engine.fuse([ids[k]])[0].fused) for k, _ in item.parts]
        prompt = Assembler(r, engine.prefix_kv()).prompt(arrays, [ids[k] for k, _ in item.parts], list(item.ids),
                                                         AssemblyOptions(recompute=3))
        logits = prompt_logits(r, prompt)
    targets = torch.tensor(item.ids[item.n_context:])
    ask_nll = torch.nn.functional.cross_entropy(logits[item.n_context - 1 : -1], targets, reduction="sum")
    assert count == len(targets) and abs(float(train_nll) - float(ask_nll)) < 1e-3
    with torch.no_grad():
        batch = [multi[0], items[3], multi[4], objectives.with_passages(items, list(ids), lengths, [3], seed=2)[1]]
        total, n = objectives.batch_nll(r, fuser, bank, prefix, batch)
        singles = [objectives.batch_nll(r, fuser, bank, prefix, [i]) for i in batch]
    assert n == sum(c for _, c in singles) and abs(float(total) - sum(float(x) for x, _ in singles)) < 1e-3


def test_retrieved_distractors_follow_ask_order(tiny_dirs, squad_file, tmp_path):
    """Retrieved distractors are BM25's top k in ask's order, the answer's passage kept; the k mix is split evenly."""
    from cachegraft_cli.lm.models import load_causal_lm
    from cachegraft_cli.training.data import read_files
    from cachegraft_cli.training.setup import build_items, rank_passages, select_passages

    cfg = _config(tiny_dirs, squad_file, tmp_path / "r", passages_per_item=[1, 3], val_fraction=0.0, recompute=2)
    cfg.check()
    r = load_causal_lm(str(tiny_dirs["receiver"]), device="cpu", dtype="float32")
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    ds = read_files(cfg.data)
    ids, train, _ = select_passages(cfg, tpl, ds, None)
    built = build_items(cfg, tpl, ids, train, ds.questions, ds.passages)
    questions = [q for q in ds.questions if q.passage in set(train)]
    ranked = rank_passages(questions, [ds.passages[k] for k in train], 3)
    assert sum(len(i.parts) > 1 for i in built) >= 2
    for item, ranking in zip(built, ranked):
        keys = [k for k, _ in item.parts]
        if len(keys) == 1:
            assert keys == [item.passage] and item.recompute == ()
            continue
        top = ranking[:3] if item.passage in ranking[:3] else ranking[:2] + [item.passage]
        assert keys == top[::-1]  # ask's order: the best passage last, next to the question
        assert len(item.recompute) == sum(min(2, n) for _, n in item.parts[1:])


def test_holdout_removes_the_evaluated_corpus(tiny_dirs, squad_file, tmp_path):
    from cachegraft_cli.training.data import read_files
    from cachegraft_cli.training.setup import without_holdout

    cfg = _config(tiny_dirs, squad_file, tmp_path / "h", holdout=[f"h={squad_file}?articles=1"])
    kept, removed = without_holdout(cfg, read_files(cfg.data))
    full = read_files(cfg.data)
    assert removed > 0 and len(kept.passages) == len(full.passages) - removed
    assert all(q.passage in kept.passages for q in kept.questions)
    with pytest.raises(TrainingError, match="--holdout"):
        without_holdout(_config(tiny_dirs, squad_file, tmp_path / "h2", holdout=[str(tmp_path / "nope.json")]), full)


def test_sharer_notes_follow_each_passage_as_encode_stores_them(tiny_dirs, tiny_models, squad_file, tmp_path):
    """train-fuser --sharer-notes N trains on passage + the sharer's notes, the token ids `encode
    --sharer-notes N` caches; the notes are kept in OUT/notes.json and reused by a repeated run."""
    from cachegraft_cli.encoding.notes import write_notes
    from cachegraft_cli.lm.template import DEFAULT_INSTRUCTION
    from cachegraft_cli.store.rows import with_notes
    from cachegraft_cli.training.data import read_files
    from cachegraft_cli.training.setup import extend_ids_with_notes, select_passages

    summary = run(_config(tiny_dirs, squad_file, tmp_path / "n", sharer_notes=5, max_steps=2), progress=False)
    info = summary["data"]["notes"]
    (file,) = (tmp_path / "n").glob("notes-*.json")  # --cache-dir none: beside the run's output
    saved = json.loads(file.read_text())
    assert info["written"] == info["passages"] == len(saved["notes"]) > 0 and info["file"] == str(file)
    s, r = tiny_models["sharer_same"], tiny_models["receiver"]
    cfg = _config(tiny_dirs, squad_file, tmp_path / "n", sharer_notes=5)
    ds = read_files(cfg.data)
    tpl = PromptTemplate.for_tokenizer(r.tokenizer)
    ids, train, val = select_passages(cfg, tpl, ds, None)
    keys = sorted(saved["notes"])
    assert set(keys) == set(train + val)
    fresh = write_notes(s, DEFAULT_INSTRUCTION, [(ds.passages[k].title, ds.passages[k].text) for k in keys], 5)
    assert fresh == [saved["notes"][k] for k in keys]  # greedy: the same notes every time
    plain = {k: list(v) for k, v in ids.items()}
    # no sharer: the saved notes serve
    again = extend_ids_with_notes(cfg, None, tpl, ds.passages, ids, keys, progress=False)
    assert again is not None and again["written"] == 0
    for k in keys:
        passage = ds.passages[k]
        assert ids[k] == tpl.passage_ids(passage.title, with_notes(passage.text, saved["notes"][k]))
    assert sum(len(ids[k]) - len(plain[k]) for k in keys) == info["tokens_added"] > 0
    with pytest.raises(TrainingError, match="--sharer-notes"):
        _config(tiny_dirs, squad_file, tmp_path / "bad", sharer_notes=-1).check()
