"""Relative RMS error (and attention-logit error) of int4 key variants on real receiver caches."""
import numpy as np
from transformers import AutoTokenizer
from cachegraft_cli.store.store import CacheStore
from cachegraft_cli.store.codecs import get_codec
from cachegraft_cli.template import PromptTemplate

st = CacheStore.open('/tmp/cachegraft-bench/p3-closed-auto-s0-n41-float32')
arrs = st.read(st.ids())
tok = AutoTokenizer.from_pretrained('/root/.cache/cachegraft-test-models/qwen2.5-coder-0.5b-instruct')
pre = len(PromptTemplate.for_tokenizer(tok).prefix_ids())
D = 64; theta = 1e6
inv = theta ** (-np.arange(0, D, 2) / D)

def rot(k, pos, sign):  # k (T, L, H, D); HF rotate_half convention
    ang = np.outer(pos, inv) * sign  # (T, D/2)
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, None, :]
    half = np.concatenate([-k[..., D // 2:], k[..., :D // 2]], -1)
    return k * cos + half * sin

def q_sym(k, g, levels=7):
    out = np.empty_like(k)
    for s in range(0, len(k), g):
        blk = k[s:s + g]; sc = np.abs(blk).max(0) / levels; sc[sc == 0] = 1
        out[s:s + g] = np.clip(np.round(blk / sc), -levels, levels) * sc
    return out

def q_asym(k, g, levels=15):
    out = np.empty_like(k)
    for s in range(0, len(k), g):
        blk = k[s:s + g]; lo, hi = blk.min(0), blk.max(0); sc = (hi - lo) / levels; sc[sc == 0] = 1
        out[s:s + g] = np.clip(np.round((blk - lo) / sc), 0, levels) * sc + lo
    return out

def err(a, b):
    return float(np.sqrt(((a - b) ** 2).sum() / (a ** 2).sum()))

codec = get_codec('int4', {'layers': 24, 'kv_heads': 2, 'head_dim': 64})
res = {}
for x in arrs:
    k = x[:, :, 0]; v = x[:, :, 1]
    pos = pre + np.arange(len(k))
    raw = rot(k, pos, -1)
    dec = codec.decode(codec.encode(x), 0, len(x))
    variants = {
        'shipped int4 (sym, g32)': dec[:, :, 0],
        'sym g16': q_sym(k, 16),
        'asym g32': q_asym(k, 32),
        'pre-RoPE sym g32': rot(q_sym(raw, 32), pos, 1),
        'pre-RoPE asym g32': rot(q_asym(raw, 32), pos, 1),
    }
    for name, kq in variants.items():
        res.setdefault(name, []).append(err(k, kq))
    res.setdefault('values (shipped)', []).append(err(v, dec[:, :, 1]))
for name, e in res.items():
    print(f"{name:28s} rel RMS {np.mean(e):.4f}")

def qv_sym(v, g, levels=7):
    s = v.reshape(v.shape[:-1] + (-1, g)); sc = np.abs(s).max(-1, keepdims=True) / levels; sc[sc == 0] = 1
    return (np.clip(np.round(s / sc), -levels, levels) * sc).reshape(v.shape)

def qv_asym(v, g, levels=15):
    s = v.reshape(v.shape[:-1] + (-1, g)); lo, hi = s.min(-1, keepdims=True), s.max(-1, keepdims=True)
    sc = (hi - lo) / levels; sc[sc == 0] = 1
    return (np.clip(np.round((s - lo) / sc), 0, levels) * sc + lo).reshape(v.shape)

res2 = {}
for x in arrs:
    k = x[:, :, 0]; v = x[:, :, 1]
    for name, f in {'V sym g64': lambda: qv_sym(v, 64), 'V sym g32': lambda: qv_sym(v, 32), 'V sym g16': lambda: qv_sym(v, 16),
                    'V asym g64': lambda: qv_asym(v, 64), 'V asym g32': lambda: qv_asym(v, 32),
                    'K sym g64': lambda: (k, q_sym(k, 64)), 'K asym g64': lambda: (k, q_asym(k, 64))}.items():
        out = f()
        if isinstance(out, tuple):
            res2.setdefault(name, []).append(err(*out))
        else:
            res2.setdefault(name, []).append(err(v, out))
for name, e in res2.items():
    print(f"{name:28s} rel RMS {np.mean(e):.4f}")
