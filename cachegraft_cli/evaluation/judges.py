"""LLM judges: a causal LM reads question, gold answers and a candidate.

The verdict is read from next-token probabilities at the end of a fixed
answer format ("Verdict (yes or no):"): P(yes) / (P(yes) + P(no)), where each
side sums the probabilities of the first tokens of a few spellings. Pairwise
judging shows both answers as A and B, in a seeded random order and then
swapped, and averages the two readings to cancel position bias.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cachegraft_cli.errors import ModelLoadError

MAX_ANSWER_CHARS = 1000
_SLOT = "\x00CG_JUDGE_PROMPT\x00"  # marks where the prompt goes in the rendered chat template
YES_WORDS = (" yes", "yes", " Yes", "Yes")
NO_WORDS = (" no", "no", " No", "No")
A_WORDS = (" A", "A")
B_WORDS = (" B", "B")

POINTWISE_PROMPT = (
    "You are grading an answer to a question.\n"
    "Question: {question}\n"
    "Correct answers: {golds}\n"
    "Candidate answer: {candidate}\n"
    "Does the candidate answer mean the same as one of the correct answers?\n"
    "Verdict (yes or no):"
)
PAIRWISE_PROMPT = (
    "You are comparing two answers to a question.\n"
    "Question: {question}\n"
    "Correct answers: {golds}\n"
    "Answer A: {first}\n"
    "Answer B: {second}\n"
    "Which answer agrees better with the correct answers?\n"
    "Better answer (A or B):"
)


@dataclass(frozen=True)
class JudgeItem:
    question: str
    golds: Sequence[str]
    candidate: str


@dataclass(frozen=True)
class Verdict:
    verdict: int  # 1 correct, 0 incorrect
    probability: float  # P(correct)


@dataclass(frozen=True)
class PairItem:
    key: str  # stable id: seeds the presentation order
    question: str
    golds: Sequence[str]
    answer_a: str
    answer_b: str


@dataclass(frozen=True)
class PairVerdict:
    verdict: str  # "a", "b" or "tie"
    prob_a: float  # P(A better), averaged over both orders


class Judge(Protocol):
    name: str

    def judge(self, items: Sequence[JudgeItem]) -> list[Verdict]: ...

    def close(self) -> None: ...


def judge_name(spec: str) -> str:
    """Short display name: last path or hub component, without .gguf."""
    name = Path(spec.rstrip("/")).name or spec
    return name[:-5] if name.endswith(".gguf") else name


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ANSWER_CHARS else text[:MAX_ANSWER_CHARS] + " ..."


def pointwise_prompt(item: JudgeItem) -> str:
    golds = " | ".join(item.golds) or "(none)"
    return POINTWISE_PROMPT.format(question=item.question, golds=golds, candidate=_clip(item.candidate))


def pairwise_prompt(item: PairItem, a_first: bool) -> str:
    first, second = (item.answer_a, item.answer_b) if a_first else (item.answer_b, item.answer_a)
    golds = " | ".join(item.golds) or "(none)"
    return PAIRWISE_PROMPT.format(question=item.question, golds=golds, first=_clip(first), second=_clip(second))


class LMJudge:
    """A judge backed by a loaded transformers causal LM and its tokenizer."""

    def __init__(self, model, tokenizer, name: str = "judge", batch_size: int = 8):
        self.model, self.tokenizer, self.name, self.batch_size = model, tokenizer, name, batch_size
        _ensure_pad_token(tokenizer)
        self._yes, self._no = _label_token_ids(tokenizer, YES_WORDS, NO_WORDS)
        self._a, self._b = _label_token_ids(tokenizer, A_WORDS, B_WORDS)

    def judge(self, items: Sequence[JudgeItem]) -> list[Verdict]:
        probs = self.label_probabilities([pointwise_prompt(i) for i in items], self._yes, self._no)
        return [Verdict(int(p >= 0.5), p) for p in probs]

    def judge_pairs(self, items: Sequence[PairItem], seed: int = 0) -> list[PairVerdict]:
        """Each pair is read in a seeded random order and in the swapped order."""
        firsts = [random.Random(f"{seed}:{item.key}").random() < 0.5 for item in items]
        prompts = [pairwise_prompt(i, f) for i, f in zip(items, firsts)]
        prompts += [pairwise_prompt(i, not f) for i, f in zip(items, firsts)]
        p_first = self.label_probabilities(prompts, self._a, self._b)
        n = len(items)
        return [_pair_verdict(p_first[i], p_first[n + i], firsts[i]) for i in range(n)]

    def label_probabilities(self, prompts: Sequence[str], pos: list[int], neg: list[int]) -> list[float]:
        """P(pos) / (P(pos) + P(neg)) for the next token after each prompt."""
        ids = [self.prompt_ids(p) for p in prompts]
        # by length of the rendered prompt, as the template adds the same text to every prompt
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out = [0.0] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, p in zip(batch, self._score_batch([ids[i] for i in batch], pos, neg)):
                out[i] = p
        return out

    def prompt_ids(self, prompt: str) -> list[int]:
        """The judge prompt as token ids. The question, gold and candidate answers in it are user
        and model text: no control token comes from them (an answer holding "<|im_end|>" cannot
        end the judge's turn and write its verdict); the chat template's own stay."""
        from cachegraft_cli.lm.plaintext import mixed_ids, plain_prompt_ids

        if not getattr(self.tokenizer, "chat_template", None):
            return plain_prompt_ids(self.tokenizer, prompt)
        head, tail = self._render(_SLOT).split(_SLOT)
        return mixed_ids(self.tokenizer, [(head, False), (prompt, True), (tail, False)])

    def _render(self, prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=False)
        except TypeError:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _score_batch(self, batch: list[list[int]], pos: list[int], neg: list[int]) -> list[float]:
        import torch

        probs = self._next_token_probs(batch)
        p_pos, p_neg = probs[:, pos].sum(-1), probs[:, neg].sum(-1)
        total = torch.clamp(p_pos + p_neg, min=1e-30)
        return [float(x) for x in (p_pos / total).clamp(0.0, 1.0)]

    def _next_token_probs(self, batch: list[list[int]]):
        import torch

        self.tokenizer.padding_side = "left"
        enc = self.tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        device = next(self.model.parameters()).device
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # left pads must not shift positions
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        return torch.softmax(logits[:, -1, :].float(), dim=-1)

    def close(self) -> None:
        self.model = None
        _free_accelerator_memory()


def _pair_verdict(p_first_shown: float, p_first_swapped: float, a_first: bool) -> PairVerdict:
    """Turn 'first shown is better' probabilities of both orders into P(A better)."""
    p_a_1 = p_first_shown if a_first else 1.0 - p_first_shown
    p_a_2 = 1.0 - p_first_swapped if a_first else p_first_swapped
    if p_a_1 > 0.5 and p_a_2 > 0.5:
        verdict = "a"
    elif p_a_1 < 0.5 and p_a_2 < 0.5:
        verdict = "b"
    else:
        verdict = "tie"
    return PairVerdict(verdict, (p_a_1 + p_a_2) / 2)


def _ensure_pad_token(tokenizer) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError("The judge tokenizer has neither a pad nor an end-of-sequence token.")
        tokenizer.pad_token = tokenizer.eos_token


def _label_token_ids(tokenizer, pos_words: Sequence[str], neg_words: Sequence[str]) -> tuple[list[int], list[int]]:
    pos_set, neg_set = _first_tokens(tokenizer, pos_words), _first_tokens(tokenizer, neg_words)
    shared = pos_set & neg_set
    pos, neg = sorted(pos_set - shared), sorted(neg_set - shared)
    if not pos or not neg:
        raise ModelLoadError(f"The judge tokenizer cannot tell {pos_words[0]!r} from {neg_words[0]!r} "
                             "by their first tokens.", "Use another judge model.")
    return pos, neg


def _first_tokens(tokenizer, words: Sequence[str]) -> set[int]:
    ids = set()
    for word in words:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if encoded and encoded[0] != tokenizer.unk_token_id:
            ids.add(encoded[0])
    return ids


def _free_accelerator_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


LoadModel = Callable[[str], object]  # spec -> (model, tokenizer) or an object with .model, .tokenizer


def default_load_model(spec: str):
    from cachegraft_cli.lm.models import load_causal_lm  # lazy: heavy

    return load_causal_lm(spec)


def _unpack(loaded) -> tuple:
    if hasattr(loaded, "model") and hasattr(loaded, "tokenizer"):
        return loaded.model, loaded.tokenizer
    model, tokenizer = loaded
    return model, tokenizer


def load_judge(spec: str, load_model: LoadModel | None = None, batch_size: int = 8,
               name: str | None = None) -> LMJudge:
    """Load a judge from a hub id, local directory or GGUF file."""
    model, tokenizer = _unpack((load_model or default_load_model)(spec))
    model.eval()
    return LMJudge(model, tokenizer, name or judge_name(spec), batch_size)
