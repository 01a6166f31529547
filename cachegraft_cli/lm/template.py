"""The prompt template every system shares, as token ids.

The prompt is `prefix + passage blocks + question suffix`. The prefix (chat
start, system instruction, start of the user turn) is encoded once per store;
each passage block is encoded on its own after the prefix; the question suffix
closes the user turn and opens the assistant turn. Pieces are tokenized
separately and concatenated as ids, so every system (text, cache, graft) sees
exactly the same ids.

Passages and questions are user text: no control token comes from them
(`lm.plaintext`), while the template's own ("<|im_end|>" closing the user turn)
stay control tokens. The prefix is the operator's (the chat template and the
store's instruction) and is read as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachegraft_cli.lm.plaintext import mixed_ids, plain_ids

DEFAULT_INSTRUCTION = (
    "Answer the question using the documents. Reply with a short answer only: a few words, no explanation."
)
_DOCS = "\x00CG_DOCS\x00"
_QUESTION = "\x00CG_QUESTION\x00"
TEMPLATE_VERSION = 1


@dataclass
class PromptTemplate:
    tokenizer: Any  # a transformers tokenizer
    prefix_text: str
    suffix_text: str  # contains the question slot
    chat: bool
    instruction: str

    @classmethod
    def for_tokenizer(cls, tokenizer, instruction: str = DEFAULT_INSTRUCTION) -> "PromptTemplate":
        if getattr(tokenizer, "chat_template", None):
            prefix, suffix = _split_chat(tokenizer, instruction)
            return cls(tokenizer, prefix, suffix, True, instruction)
        bos = tokenizer.bos_token or ""
        prefix = f"{bos}{instruction}\n\nDocuments:\n"
        return cls(tokenizer, prefix, "Question: " + _QUESTION + "\nAnswer:", False, instruction)

    def prefix_ids(self) -> list[int]:
        # the operator's text (chat template, instruction): its control tokens are the template's
        return list(self.tokenizer(self.prefix_text, add_special_tokens=False)["input_ids"])

    def passage_block(self, title: str, text: str) -> str:
        return passage_block(title, text)

    def passage_ids(self, title: str, text: str) -> list[int]:
        """The block's ids: the title and text are corpus text only, so the block is read plainly."""
        return plain_ids(self.tokenizer, self.passage_block(title, text))

    def question_ids(self, question: str) -> list[int]:
        """The suffix's ids: its control tokens stay, the question gives none."""
        head, *rest = self.suffix_text.split(_QUESTION)
        parts = [(head, False)] + [part for tail in rest for part in ((question.strip(), True), (tail, False))]
        return mixed_ids(self.tokenizer, parts)

    def identity(self) -> dict:
        """What a stored cache depends on (pinned in store metadata)."""
        return {
            "version": TEMPLATE_VERSION,
            "chat": self.chat,
            "instruction": self.instruction,
            "prefix_text": self.prefix_text,
            "suffix_text": self.suffix_text.replace(_QUESTION, "{question}"),
            "passage_block": self.passage_block("{title}", "{text}"),
        }


def passage_block(title: str, text: str) -> str:
    """The text a passage's cache is computed from (the same for every tokenizer)."""
    head = f"Title: {title}\n" if title else ""
    return f"{head}{text.strip()}\n\n"


def _split_chat(tokenizer, instruction: str) -> tuple[str, str]:
    messages = [
        {"role": "system", "content": instruction},
        {"role": "user", "content": f"Documents:\n{_DOCS}Question: {_QUESTION}"},
    ]
    try:
        rendered = _render(tokenizer, messages)
    except Exception:  # noqa: BLE001 - jinja raises its own errors for templates that reject a system role
        rendered = ""
    if _DOCS not in rendered:  # templates without a system role: fold the instruction into the user turn
        messages = [{"role": "user", "content": f"{instruction}\n\nDocuments:\n{_DOCS}Question: {_QUESTION}"}]
        rendered = _render(tokenizer, messages)
    prefix, rest = rendered.split(_DOCS)
    return prefix, rest


def _render(tokenizer, messages) -> str:
    # enable_thinking=False keeps Qwen3's template from opening a reasoning block; others ignore it.
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
