"""Test helpers for `test_pull.py`: a tiny synthetic GGUF model and wheels that carry it."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 16, 2, 4, 2, 32


def _byte_vocab() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


def _tokenizer_fields() -> dict:
    vocab = _byte_vocab()
    merges = ["h e", "l l", "o Ġ", "Ġ w"]
    tokens = vocab + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]  # 1 normal, 3 control
    return {"tokens": tokens, "types": types, "merges": merges, "eos": len(tokens) - 1}


def _bf16_exact(rng: np.random.Generator, *shape: int, scale: float = 0.2) -> np.ndarray:
    """Random float32 values that bf16 holds exactly, so a bf16 copy loses nothing."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _tensors(vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    kv = HIDDEN // HEADS * KV_HEADS
    out = {"token_embd.weight": _bf16_exact(rng, vocab, HIDDEN), "output.weight": _bf16_exact(rng, vocab, HIDDEN)}
    out["output_norm.weight"] = np.ones(HIDDEN, np.float32)
    for i in range(LAYERS):
        shapes = {
            "attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
        }
        out.update({f"blk.{i}.{k}.weight": _bf16_exact(rng, *s) for k, s in shapes.items()})
        out[f"blk.{i}.attn_norm.weight"] = np.ones(HIDDEN, np.float32)
        out[f"blk.{i}.ffn_norm.weight"] = np.ones(HIDDEN, np.float32)
    return out


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama-architecture GGUF with a byte-level BPE vocabulary of 261 tokens."""
    import gguf

    tok = _tokenizer_fields()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tok["tokens"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_eos_token_id(tok["eos"])
    w.add_bos_token_id(tok["eos"])
    for name, array in _tensors(len(tok["tokens"]), seed).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(folder: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid py3-none-any wheel holding `members` (what `pip download` needs to accept it)."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: cachegraft-tests\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = "\n".join([_record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]) + "\n"
    files[f"{info}/RECORD"] = record.encode()
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def chunk_into_wheels(blob: bytes, folder: Path, dist: str, version: str, parts: int) -> list[tuple[str, str, str]]:
    """Split `blob` into `parts` wheels `dist-part{i}`; returns (distribution, version, member) in order."""
    size = -(-len(blob) // parts)
    out = []
    for i in range(1, parts + 1):
        part_dist = f"{dist}-part{i}"
        member = f"{part_dist.replace('-', '_')}/data/part{i:02d}.bin"
        write_wheel(folder, part_dist, version, {member: blob[(i - 1) * size : i * size]})
        out.append((part_dist, version, member))
    return out
