"""Tiny random-weight models and tokenizers, built offline from configs.

Two tokenizers (byte-level BPEs trained on different text with different
vocabulary sizes and special tokens) and three model shapes:
- receiver: Qwen2, 4 layers, 2 KV heads x 16
- sharer_same: Qwen3, 6 layers, 3 KV heads x 32, the receiver's tokenizer
- sharer_other: Llama, 3 layers, 1 KV head x 12, its own tokenizer
"""

from __future__ import annotations

from pathlib import Path

_TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Harbor town was founded in 1820 by fishermen who built the first lighthouse.",
    "Question: who built the lighthouse? Answer: the fishermen of Harbor town.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The treaty was signed in Vienna after long talks between the two empires.",
    "Numbers like 1234, 56.7 and 8% appear in reports; émigré café naïve über.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(path: Path, kind: str):
    """kind 'a': Qwen-like specials + chat template; kind 'b': Llama-like <s>/</s>/<unk>, no template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "a":
        specials, vocab, text = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 320, _TRAIN_TEXT
    else:
        specials, vocab, text = ["<unk>", "<s>", "</s>"], 420, [t.upper() + " " + t for t in _TRAIN_TEXT[:6]] * 10
    tok = Tokenizer(models.BPE(unk_token="<unk>" if kind == "b" else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    if kind == "a":
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        fast.chat_template = CHAT_TEMPLATE
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


def build_model(path: Path, shape: str, vocab_size: int, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, max_position_embeddings=512, tie_word_embeddings=False)
    configs = {
        "receiver": lambda: Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, **common),
        "sharer_same": lambda: Qwen3Config(
            hidden_size=96, intermediate_size=160, num_hidden_layers=6, num_attention_heads=6,
            num_key_value_heads=3, head_dim=32, rope_theta=1000000.0, **common),
        "micro": lambda: Qwen2Config(  # for tests that stream very many passages: 16 cache values per token
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, rope_theta=10000.0, **common),
        "sharer_other": lambda: LlamaConfig(
            hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, rope_theta=500000.0, bos_token_id=1, eos_token_id=2, **common),
    }
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[shape]())
    _scale_up(model)
    model.save_pretrained(path)
    return model


def _scale_up(model) -> None:
    """Random init with std 0.02 gives near-uniform logits; larger weights make
    argmax decisions (and so token-level comparisons) meaningful."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)


def build_micro(root: Path, tokenizer_from: Path | None = None) -> Path:
    """A one-layer receiver (tokenizer a, trained here or taken from `tokenizer_from`) for streaming tests."""
    if tokenizer_from is None:
        tok = build_tokenizer(root / "tok_micro", "a")
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_from)
    build_model(root / "micro", "micro", len(tok), 4)
    tok.save_pretrained(root / "micro")
    return root / "micro"


def build_all(root: Path) -> dict[str, Path]:
    """Build tokenizers and models under root; returns model dirs by role."""
    dirs = {}
    tok_a = build_tokenizer(root / "tok_a", "a")
    tok_b = build_tokenizer(root / "tok_b", "b")
    for role, tok, seed in (("receiver", tok_a, 1), ("sharer_same", tok_a, 2), ("sharer_other", tok_b, 3)):
        d = root / role
        build_model(d, role, len(tok), seed)
        tok.save_pretrained(d)
        dirs[role] = d
    return dirs


def open_fuser(receiver, sharer, seed: int = 0, width: int = 32, **spec):
    """A random fuser from `sharer` into `receiver` (loaded models) with its hard gates open, so
    fusion is not the identity; `width` is its hidden and intermediate size, `spec` other
    `Fuser.create` options (`sharer_input="zero"`: the adapter control). In eval mode."""
    import torch

    from cachegraft_cli.fuser.fuser import Fuser

    torch.manual_seed(seed)
    fuser = Fuser.create(receiver.spec, sharer.spec, receiver.geometry, sharer.geometry, hidden_dim=width,
                         intermediate_dim=width, **spec)
    fuser.set_gates(1.0)  # positive logits: hard gates open
    return fuser.eval()


def saved_open_fuser(tiny_models, path: Path, seed: int = 0, **spec) -> Path:
    """`open_fuser` from the tiny `sharer_same` into the tiny receiver, saved in the published layout at `path`."""
    from cachegraft_cli.fuser.checkpoint import save_published

    save_published(open_fuser(tiny_models["receiver"], tiny_models["sharer_same"], seed=seed, **spec), path)
    return path


def fused_session(tiny_dirs, fuser_dir):
    """A float32 CPU `ModelSession`: the tiny receiver <- `sharer_same` through the fuser at `fuser_dir`."""
    from cachegraft_cli.session import ModelChoice, ModelSession

    return ModelSession(ModelChoice(str(tiny_dirs["receiver"]), str(tiny_dirs["sharer_same"]), str(fuser_dir),
                                    device="cpu", dtype="float32"))
