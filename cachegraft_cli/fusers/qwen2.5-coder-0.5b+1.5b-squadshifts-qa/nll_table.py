"""Held-out answer NLL: closed vs adapter vs fusers, on squadshifts held-out (the training runs' validation split)
and a seeded sample of squad_v1.1_dev (never trained on).

Run from anywhere with the offline models pulled (`cachegraft models pull offline`) and the QA files
of docs/data.md in $CACHEGRAFT_QA_DATA:
    CACHEGRAFT_QA_DATA=path/to/qa python nll_table.py closed=closed qa=<run dir> adapter=<run dir>
"""
import gc
import json
import os
import sys
import time

import torch

from cachegraft_cli.fuser.checkpoint import load_checkpoint
from cachegraft_cli.fuser.fuser import Fuser
from cachegraft_cli.fusion import FusionEngine
from cachegraft_cli.models import load_causal_lm
from cachegraft_cli.pull import model_dir
from cachegraft_cli.training import TrainConfig, heldout
from cachegraft_cli.training.data import read_files
from cachegraft_cli.training.precompute import CacheBank, bank_identity
from cachegraft_cli.training.setup import build_items, cap_items, select_passages, template_for

M = str(model_dir("qwen2.5-coder-0.5b-instruct").parent)
D = os.environ["CACHEGRAFT_QA_DATA"]
fusers = dict(a.split("=", 1) for a in sys.argv[1:])
torch.manual_seed(0)
r = load_causal_lm(f"{M}/qwen2.5-coder-0.5b-instruct", device="cpu", dtype="float32")
r.model.requires_grad_(False)
s = load_causal_lm(f"{M}/qwen2.5-coder-1.5b-instruct", device="cpu", dtype="bfloat16")
s.model.requires_grad_(False)
cfg = TrainConfig(
    receiver=r.spec,
    sharer=s.spec,
    data=[f"{D}/squadshifts_nyt.json", f"{D}/squadshifts_new_wiki.json"],
    out="-",
    max_passages=12,
    max_val_passages=4,
    max_val_items=12,
    max_passage_tokens=150,
    seed=0,
)
tpl = template_for(cfg, r)
ds = read_files(cfg.data)
ids, _, val_keys = select_passages(cfg, tpl, ds, None)
shifts = cap_items(build_items(cfg, tpl, ids, val_keys, ds.questions, ds.passages), cfg.max_val_items, cfg.seed)
dev_ids, dev_q = heldout.sample_questions(f"{D}/squad_v1.1_dev.json", tpl, 150, passages=4, per_passage=3, seed=0)
dev = heldout.items_for(tpl, dev_ids, dev_q)
probe = Fuser.create(r.spec, s.spec, r.geometry, s.geometry, hidden_dim=8, intermediate_dim=8)
engine = FusionEngine(r, tpl.prefix_ids(), s, probe)
bank_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), "cachegraft-nll-bank")
bank = CacheBank(bank_identity(r, s, tpl, "bfloat16"), "bfloat16", bank_dir)
t = time.time()
bank.fill(engine, {**{k: ids[k] for k in val_keys}, **dev_ids}, batch_size=4)
print("fill", time.time() - t, file=sys.stderr)
prefix = [(k.float().unsqueeze(0), v.float().unsqueeze(0)) for k, v in engine.prefix_kv()]
engine.sharer = None
del engine, s
gc.collect()
while not all(p == "closed" or os.path.exists(os.path.join(p, "summary.json")) for p in fusers.values()):
    time.sleep(20)
loaded = {name: (None if path == "closed" else load_checkpoint(path)) for name, path in fusers.items()}
res = {}
for name, items in (("squadshifts_heldout", shifts), ("squad_v1.1_dev_sample", dev)):
    res[name] = {"questions": len(items), "passages": len({i.passage for i in items}),
                 **heldout.compare(r, bank, prefix, items, loaded)}
    print(name, res[name], file=sys.stderr, flush=True)
print(json.dumps(res, indent=1))
