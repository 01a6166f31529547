"""Codec fidelity: what a codec does to the receiver's next-token distributions (real models).

The yardstick for codec decisions. F1 on a few hundred questions cannot see one point (when
5-10% of answers change, its paired standard error is 2-3 points); the model's distributions
can. Questions with gold answers from the QA sets in ../shared/data/qa/ (SQuAD v1.1 dev,
SQuADShifts new_wiki and nyt, pooled; each set its own corpus of the sampled paragraphs) are
answered with `graft` at each k. Every codec's store holds the very same fused caches as a
lossless float32 store (encoded once, transcoded), and retrieval is the lossless store's, so
each question reads the same passages from every store. Per codec, paired per question
against float32:

- dNLL: teacher-forced NLL of the gold answer's tokens (mean per token), codec minus lossless;
- KL(lossless || codec) of the next-token distributions over the question and answer tokens
  (per question the mean over its positions; also the 99th percentile over all positions);
- top-1: how often the greedy next token agrees, over the same positions;
- flips: the share of greedy 16-token answers that change (the lossless greedy answer is
  teacher-forced under the codec: it changes exactly when some step's argmax differs);
- stored bytes per token (manifest bytes, compressed) and the ratio to raw bf16.

`weights:int8` and `weights:int4` are judged the same way: the lossless store, read by the
receiver with weight-only int8 / int4 linears against the receiver as loaded, as `--weights`
runs them: the question is read with the exact weights and the answer's tokens go through the
quantised ones (so the question's own positions add KL 0; the answer's carry it all).

Means come with a bootstrap 95% interval over questions (seeded). One forward pass per
question, codec and k for the gold answer and one for the greedy answer; no generation but
the lossless one.

    python benchmarks/codec_fidelity.py [--per-set 200] [--k 3,5] [--codecs bf16,int8,int4,k8v4,k2v4]
                                        [--fuser builtin:...|closed|DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import bench_common as bc
import numpy as np

SETS = {"squad": "squad_v1.1_dev.json", "new_wiki": "squadshifts_new_wiki.json", "nyt": "squadshifts_nyt.json"}
OFFLINE_FUSER = "builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135"  # the offline preset's
FLIP_TOKENS = 16


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-set", type=int, default=200, help="questions from each of the three sets")
    ap.add_argument("--ask", type=int, default=None,
                    help="ask only the first N of each set's questions (the corpus stays --per-set's)")
    ap.add_argument("--k", default="3,5")
    ap.add_argument("--codecs", default="bf16,int8,int4,k8v4,k2v4",
                    help="codecs compared with float32; tc:KEY/VALUE[-nopred][-notransform][-noentropy] adds the "
                         "transform codec at those quantiser steps, calibrated on --calibration-store (-noentropy: "
                         "the same reconstruction with fixed-length symbols, its size counted, not written); "
                         "tc@STEP[vSTEP][...] the numpy probe (tc_probe.py); tcfile:PATH the transform codec with "
                         "the calibration in PATH; weights:int8 / weights:int4 the receiver's weight-only "
                         "int8 / int4 linears (cachegraft_cli/lm/weights.py) reading the lossless store")
    ap.add_argument("--calibration-store", default=None,
                    help="the store tc: codecs are calibrated on (default: the offline preset's calibration corpus, "
                         "benchmarks/calibration_corpus.py, encoded float32 here)")
    ap.add_argument("--calibration-passages", type=int, default=250)
    ap.add_argument("--fuser", default=OFFLINE_FUSER)
    ap.add_argument("--distractors", type=int, default=60, help="paragraphs per set beyond the questions' own")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--json", default=None, help="also write every figure here")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- stores


def build_stores(name: str, passages, session, codecs: list[str], tag: str, args) -> tuple[dict[str, str], dict]:
    """A float32 store of the set's paragraphs and its transcodes, one url per codec; and the
    byte figures of each (for `tc@...` probes: the probe's measured bits, see `tc_probe.py`)."""
    from codec_quality import bytes_per_token, transcode

    base = str(bc.WORK_DIR / f"fidelity-{tag}-{bc.DTYPE or 'auto'}-{name}-n{len(passages)}")
    urls = {"float32": f"{base}-float32"}
    bc.ensure_store(urls["float32"], passages, session, codec="float32")
    sizes = {}
    for codec in [c for c in codecs if c.startswith("weights:")]:
        sizes[codec] = bytes_per_token(urls["float32"])  # the lossless store, read by other weights
    for codec in [c for c in codecs if not c.startswith("weights:")]:
        urls[codec] = f"{base}-{codec.replace('/', 'v')}" if not codec.startswith("tcfile:") else \
            f"{base}-tcfile-{os.path.basename(codec.split(':', 1)[1])}"
        if codec.startswith("tc@"):
            sizes[codec] = probe_store(urls["float32"], urls[codec], codec)
        elif codec.startswith("tc:") and codec.endswith("-noentropy"):
            sizes[codec] = fixed_length_size(calibration(codec.removesuffix("-noentropy"), session, args),
                                             bytes_per_token(urls[codec.removesuffix("-noentropy")]))
        elif codec.startswith(("tc:", "tcfile:")):
            transcode(urls["float32"], urls[codec], "tc", {"calibration": calibration(codec, session, args)})
            sizes[codec] = bytes_per_token(urls[codec])
        else:
            transcode(urls["float32"], urls[codec], codec)
            sizes[codec] = bytes_per_token(urls[codec])
    return urls, sizes


_CALIBRATIONS: dict = {}


def calibration(codec: str, session, args):
    """The calibration of `tc:KEY/VALUE[-nopred][-notransform]`, fitted once on the calibration store."""
    from cachegraft_cli.encoding.calibration import fit_from_store
    from cachegraft_cli.store.transform import FitOptions

    if codec.startswith("tcfile:"):  # a calibration file (`store calibrate`, `layer_sensitivity.py --out`)
        from cachegraft_cli.encoding.calibration import load_file

        return _CALIBRATIONS.setdefault(codec, load_file(codec.split(":", 1)[1]))
    if codec not in _CALIBRATIONS:
        steps, *flags = codec[3:].split("-")
        key_step, value_step = (float(v) for v in steps.split("/"))
        settings = FitOptions(key_step=key_step, value_step=value_step, predict="nopred" not in flags,
                               transform="notransform" not in flags)
        t0 = time.perf_counter()
        _CALIBRATIONS[codec] = fit_from_store(calibration_store(session, args), settings)[0]
        bc.log(f"{codec}: calibrated on {_CALIBRATIONS[codec].info['tokens']:,} tokens in "
               f"{time.perf_counter() - t0:.0f}s ({len(_CALIBRATIONS[codec].to_bytes()):,} bytes)")
    return _CALIBRATIONS[codec]


def calibration_store(session, args) -> str:
    if args.calibration_store:
        return args.calibration_store
    from calibration_corpus import passages as corpus

    from cachegraft_cli.corpus import Passage

    picked = [Passage(f"{name}-{i}", name, text) for i, (name, text) in enumerate(corpus(120))]
    url = str(bc.WORK_DIR / f"calibration-pydoc-{bc.DTYPE or 'auto'}-n{args.calibration_passages}-float32")
    bc.ensure_store(url, picked[: args.calibration_passages], session, codec="float32")
    args.calibration_store = url
    return url


def fixed_length_size(cal, coded: dict) -> dict:
    """The -noentropy ablation: the tc store's reconstruction with each coded component's symbols
    in fixed-length fields (ceil(log2(2R+1)) bits), plus the same group heads and positions."""
    radius = cal.arrays["radius"][np.maximum(cal.arrays["klass"], 0)]
    bits = np.where(cal.arrays["klass"] >= 0, np.ceil(np.log2(2 * radius + 1)), 0).sum()
    per_token = bits / 8 + 3 * 4 / cal.info["group"] + 4
    return {**coded, "bytes_per_token": float(per_token), "ratio": float(per_token / coded["raw_bf16"])}


def probe_store(src: str, dst: str, name: str) -> dict:
    """`tc@STEP[vSTEP][-nopred][-notransform][-noentropy]`: the transform-coding probe's reconstruction
    of the lossless store, and its bytes per token (-noentropy: fixed-length symbols instead)."""
    from tc_probe import Stage, probe

    steps, *flags = name[3:].split("-")
    key_step, _, value_step = steps.partition("v")
    stage = Stage(predict="nopred" not in flags, transform="notransform" not in flags, step=float(key_step),
                  value_step=float(value_step) if value_step else None, entropy="noentropy" not in flags)
    result = probe(src, bc.RECEIVER, stage, out_url=dst if stage.entropy else None)  # -noentropy: same store
    bc.log(f"{name} on {src}: {result['bits']:.3f} bits/element (keys {result['key_bits']:.3f}, values "
           f"{result['value_bits']:.3f}; held out {result['heldout_key_bits']:.3f} / "
           f"{result['heldout_value_bits']:.3f})")
    raw = result["bytes_per_token"] / result["ratio"]  # raw bf16 bytes per token
    return {"tokens": result["tokens"], "bytes_per_token": result["bytes_per_token"], "raw_bf16": raw,
            "ratio": result["ratio"], "probe": result}


_WEIGHTS: dict = {}


def weight_variant(lm, codec: str):
    """The receiver with `weights:SCHEME` linears (a copy, made once per scheme)."""
    import copy
    from dataclasses import replace

    from cachegraft_cli.lm.weights import quantize_linears

    if codec not in _WEIGHTS:
        model = copy.deepcopy(lm.model)
        quantize_linears(model, codec.split(":", 1)[1])
        _WEIGHTS[codec] = replace(lm, model=model)
    return _WEIGHTS[codec]


def sample(path: str, per_set: int, distractors: int, seed: int):
    passages, questions = bc.squad_sample(per_set, seed, path=path)
    extra, _ = bc.squad_sample(10**9, seed + 1, path=path)
    have = {p.id for p in passages}
    passages += [p for p in extra if p.id not in have][:distractors]
    return passages, questions


# ---------------------------------------------------------------- one question


def extended(prompt, tokens: list[int]):
    """`prompt` with `tokens` read after it (plain causal prompts: the default assembly)."""
    from cachegraft_cli.lm.generation import Prompt

    if prompt.visible is not None:
        raise SystemExit("codec_fidelity measures the default assembly (no --recompute / --blend)")
    end = prompt.positions[-1] + 1
    return Prompt(prompt.past, prompt.ids + tokens, prompt.positions + list(range(end, end + len(tokens))))


def log_probs(lm, prompts: list, conts: list[list[int]], chunk: int = 8) -> list:
    """Per row, the log-probabilities `(positions, vocab)` of the next token at every question and
    continuation position but the last, with prompt `prompts[i]` (same question, same past length:
    the same passages from each store) read before continuation `conts[i]`. Rows go through the
    model `chunk` at a time, right-padded: causal attention keeps a row's pads out of its own
    positions, so each row is what a forward of its own gives."""
    import torch

    from cachegraft_cli.lm import kvcache

    out = []
    for at in range(0, len(prompts), chunk):
        group = [(extended(p, c), len(c)) for p, c in zip(prompts[at: at + chunk], conts[at: at + chunk])]
        width = max(len(p.ids) for p, _ in group)
        ids = torch.tensor([p.ids + [0] * (width - len(p.ids)) for p, _ in group], device=lm.device)
        start = group[0][0].positions[0]
        positions = torch.arange(start, start + width, device=lm.device)[None].expand(len(group), -1)
        past = [(torch.cat([p.past[n][0] for p, _ in group]), torch.cat([p.past[n][1] for p, _ in group]))
                for n in range(len(group[0][0].past))]
        with torch.inference_mode():
            logits = lm.model(input_ids=ids, cache=kvcache.to_model_cache(past, lm.model.config),
                              position_ids=positions, use_cache=False).logits
        for row, (p, n) in enumerate(group):
            length = len(p.ids) - (1 if n else 0)
            out.append(torch.log_softmax(logits[row, :length].float(), dim=-1))
    return out


def decode_log_probs(lm, prompt, cont: list[int]):
    """`log_probs` of one row as `--weights` gives them: `prompt` read with the exact weights,
    then `cont` (but its last token) in one forward through the quantised ones."""
    import torch

    from cachegraft_cli.lm import kvcache
    from cachegraft_cli.lm.weights import set_decode_rows

    device, start = lm.device, prompt.positions[-1] + 1
    with torch.inference_mode():
        set_decode_rows(lm.model, 0)
        first = lm.model(input_ids=torch.tensor([prompt.ids], device=device), use_cache=True,
                         cache=kvcache.to_model_cache(prompt.past, lm.model.config),
                         position_ids=torch.tensor([prompt.positions], device=device))
        logits = [first.logits[0]]
        if len(cont) > 1:
            set_decode_rows(lm.model, 1 << 30)
            logits.append(lm.model(input_ids=torch.tensor([cont[:-1]], device=device), cache=first.cache,
                                   position_ids=torch.arange(start, start + len(cont) - 1, device=device)[None],
                                   use_cache=True).logits[0])
    return torch.log_softmax(torch.cat(logits).float(), dim=-1)


def greedy_answer(lm, prompt) -> list[int]:
    """The lossless greedy answer's ids, with the stop token that ended it (when one did)."""
    from cachegraft_cli.lm.generation import GenerationOptions, generate, stop_ids

    gen = generate(lm, prompt, GenerationOptions(max_new_tokens=FLIP_TOKENS))
    tokens = list(gen.token_ids)
    if len(tokens) < FLIP_TOKENS:
        tokens.append(min(stop_ids(lm)))  # the step that chose to stop is scored too
    return tokens


def score(ref_gold, got_gold, got_greedy, q_len: int, gold: list[int], greedy: list[int], stops: set[int]) -> dict:
    """One question under one codec against the lossless reference (log-probs as `log_probs` gives)."""
    import torch

    kl = (ref_gold.exp() * (ref_gold - got_gold)).sum(-1).clamp_min(0)  # per position
    answer_at = torch.arange(q_len - 1, q_len - 1 + len(gold))
    gold_t = torch.tensor(gold)
    d_nll = float((ref_gold[answer_at, gold_t] - got_gold[answer_at, gold_t]).mean())
    top1 = float((ref_gold.argmax(-1) == got_gold.argmax(-1)).float().mean())
    steps = torch.arange(q_len - 1, q_len - 1 + len(greedy))
    picked = got_greedy[steps].argmax(-1).tolist()
    flipped = any(p != g and not (p in stops and g in stops) for p, g in zip(picked, greedy))
    return {"kl": float(kl.mean()), "kl_positions": kl.tolist(), "dnll": d_nll, "top1": top1, "flip": flipped}


# ---------------------------------------------------------------- reporting


def bootstrap(values: list[float], n: int, seed: int) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its bootstrap 95% interval."""
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n, len(x)))].mean(axis=1)
    return float(x.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def summarise(per_q: list[dict], n_boot: int, seed: int) -> dict:
    positions = [v for s in per_q for v in s["kl_positions"]]
    out = {"questions": len(per_q)}
    for key in ("dnll", "kl", "top1"):
        mean, lo, hi = bootstrap([s[key] for s in per_q], n_boot, seed)
        out[key] = {"mean": mean, "ci95": [lo, hi]}
    out["kl_p99"] = float(np.quantile(positions, 0.99)) if positions else 0.0
    mean, lo, hi = bootstrap([float(s["flip"]) for s in per_q], n_boot, seed)
    out["flips"] = {"share": mean, "ci95": [lo, hi]}
    return out


def fmt_ci(entry: dict, scale: float = 1.0, digits: int = 4) -> str:
    lo, hi = entry["ci95"]
    value = entry.get("mean", entry.get("share"))
    return f"{value * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"


# ---------------------------------------------------------------- main


def run_set(name: str, path: str, args, session, codecs: list[str], ks: list[int], tag: str) -> tuple[dict, dict]:
    """Per codec and k, the per-question scores of one set; and the codecs' byte figures."""

    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.answering.options import AskOptions
    from cachegraft_cli.lm.generation import stop_ids
    from cachegraft_cli.lm.plaintext import plain_ids

    passages, questions = sample(path, args.per_set, args.distractors, args.seed)
    questions = questions[: args.ask] if args.ask else questions
    same = {c: c.removesuffix("-noentropy") for c in codecs if c.endswith("-noentropy")}  # same reconstruction
    weighted = {c: weight_variant(session.receiver, c) for c in codecs if c.startswith("weights:")}
    run = [c for c in codecs if c not in same and c not in weighted]
    urls, sizes = build_stores(name, passages, session, codecs, tag, args)
    askers = {c: Asker(u, session=session) for c, u in urls.items() if c not in same}
    lm, tok = session.receiver, session.tokenizer
    stops = stop_ids(lm)
    scores: dict = {(c, k): [] for c in codecs for k in ks}
    t0 = time.perf_counter()
    for i, q in enumerate(questions):
        gold = plain_ids(tok, q.answers[0].strip())
        for k in ks:
            options = AskOptions("graft", k)
            hits = askers["float32"].retrieve(q.question, k)
            prompts = {c: askers[c].build_prompt(q.question, hits, options)[1] for c in ["float32", *run]}
            ref = prompts["float32"]
            assert all(p.ids == ref.ids and p.positions == ref.positions for p in prompts.values())
            greedy = greedy_answer(lm, ref)
            got = log_probs(lm, [ref] + [prompts[c] for c in run for _ in (0, 1)],
                            [gold] + [cont for _ in run for cont in (gold, greedy)])
            for n, codec in enumerate(run):
                scores[(codec, k)].append(score(got[0], got[1 + 2 * n], got[2 + 2 * n], len(ref.ids), gold,
                                                greedy, stops))
            for codec, other in weighted.items():
                mine = [decode_log_probs(other, ref, cont) for cont in (gold, greedy)]
                scores[(codec, k)].append(score(got[0], mine[0], mine[1], len(ref.ids), gold, greedy, stops))
            for codec, base in same.items():
                scores[(codec, k)].append(scores[(base, k)][-1])
        if (i + 1) % 25 == 0:
            bc.log(f"{name}: {i + 1}/{len(questions)} questions, {time.perf_counter() - t0:.0f}s")
    return scores, sizes


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    random.seed(args.seed)
    codecs = [c for c in args.codecs.split(",") if c and c != "float32"]
    ks = [int(k) for k in args.k.split(",")]
    session = bc.session_for(args.fuser, args.seed)
    tag = args.fuser.split(":")[-1] if args.fuser.startswith("builtin:") else args.fuser.replace("/", "_")[-40:]
    start = bc.machine()
    t0 = time.perf_counter()
    pooled: dict = {(c, k): [] for c in codecs for k in ks}
    sizes: dict = {}
    for name, file in SETS.items():
        scores, sizes[name] = run_set(name, str((bc.QA_DATA / file).resolve()), args, session, codecs, ks, tag)
        for key, values in scores.items():
            pooled[key] += values
    seconds = time.perf_counter() - t0
    table, figures = [], {}
    for codec in codecs:
        tokens = sum(sizes[s][codec]["tokens"] for s in sizes)
        stored = sum(sizes[s][codec]["bytes_per_token"] * sizes[s][codec]["tokens"] for s in sizes)
        ratio = stored / tokens / sizes["squad"][codec]["raw_bf16"]
        for k in ks:
            summary = summarise(pooled[(codec, k)], args.bootstrap, args.seed)
            figures[f"{codec}@k={k}"] = {**summary, "bytes_per_token": stored / tokens, "ratio": ratio}
            table.append([codec, k, f"{stored / tokens:,.0f}", f"{ratio:.3f}", fmt_ci(summary["dnll"]),
                          fmt_ci(summary["kl"]), f"{summary['kl_p99']:.4f}", f"{100 * summary['top1']['mean']:.2f}",
                          fmt_ci(summary["flips"], 100, 1)])
    n = len(pooled[(codecs[0], ks[0])])
    bc.print_table(f"Codec fidelity against lossless float32: {n} questions pooled over {', '.join(SETS)}, graft, "
                   f"fuser {args.fuser}, {seconds / 60:.1f} min",
                   ["codec", "k", "B/token", "x raw bf16", "dNLL/token [95% CI]", "KL mean [95% CI]", "KL p99",
                    "top-1 %", "flips % [95% CI]"], table)
    print(f"machine at start: {start}; at end: loadavg {bc.machine()['loadavg']}")
    result = {"bench": "codec_fidelity", "fuser": args.fuser, "questions": n, "k": ks, "codecs": figures,
              "sizes": sizes, "seconds": seconds, "machine_start": start, "machine_end": bc.machine()}
    bc.emit(result)
    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
