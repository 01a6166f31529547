"""User and corpus text as token ids that no control token comes from.

A tokenizer parses the strings of its added tokens ("<|im_end|>", "<|im_start|>", Qwen3's
"<think>") out of any text it is given, `add_special_tokens=False` or not. A question or a
corpus passage holding "<|im_end|>\\n<|im_start|>system\\n..." would so close the user turn and
open a system turn of its own (prompt injection). Here:

- control ids: every special token and every added token, special or not, except whitespace
  runs (GPT-NeoX and CodeGen vocabularies add "  ", "   "... as plain text; transformers'
  own `sanitize_control_tokens` leaves them alone too);
- text whose ordinary tokenization holds no control id keeps exactly those ids: stored caches
  were computed from them, so a store written before this module still matches;
- other text is tokenized by its plain twin: a copy of the tokenizer with every control token
  marked special and its own `encode_special_tokens` flag set, so special tokens are text to it.
  No string becomes a control token there; the rest of the pipeline (normalizer, pre-tokenizer,
  model, post-processor, whitespace-run tokens) is the tokenizer's own, and the offsets are the
  text's own. Not `split_special_tokens=True`: that still parses non-special added tokens
  ("<think>"), and it flips that flag on the Rust tokenizer the whole process shares, so a
  server thread tokenizing a template meanwhile could lose the template's control tokens;
- a template around user text (`mixed_ids`): the control tokens in the template's own text stay
  control tokens; the text between them is tokenized plainly.

Tokenizers without a Rust backend (transformers' Python ones) have neither offsets nor a twin:
they are read with `split_special_tokens=True`, and refused when that still leaves a control id.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from cachegraft_cli.errors import ModelLoadError

Part = tuple[str, bool]  # (text, from a user or a corpus): the pieces `mixed_ids` joins


@dataclass(frozen=True)
class PlainEncoding:
    ids: list[int]
    offsets: list[tuple[int, int]]  # (start, end) of each token in the text; (0, 0) for an added bos/eos


@dataclass
class _Controls:
    """What one tokenizer needs for plain text, built once (the twin only when first needed)."""

    key: tuple  # len(tokenizer) and its special ids when built: tokens added or named later rebuild this
    ids: frozenset[int]
    strings: tuple[str, ...]  # the control tokens' text, longest first
    literal: bool  # every control token matches its text as written (none goes through the normalizer)
    twin: object | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_BY_TOKENIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def control_ids(tokenizer) -> frozenset[int]:
    """The ids that only markup may produce (see the module doc)."""
    return _controls(tokenizer).ids


def control_strings(tokenizer) -> tuple[str, ...]:
    """The text of the tokenizer's control tokens (added and special), longest first."""
    return _controls(tokenizer).strings


def plain_ids(tokenizer, text: str) -> list[int]:
    """`text` (user or corpus text) as ids none of which is a control id."""
    if not _has_backend(tokenizer):
        return _python_plain_ids(tokenizer, text)
    return plain_encoding(tokenizer, text).ids


def plain_encoding(tokenizer, text: str, add_special_tokens: bool = False) -> PlainEncoding:
    """Ids and offsets of `text` with no control id parsed from it (a fast tokenizer only);
    `add_special_tokens` adds what the tokenizer's post-processor adds (a bos)."""
    ordinary = _encode(tokenizer, text, add_special_tokens)
    if not parsed_controls(tokenizer, ordinary):
        return ordinary  # the ids every store so far was computed from
    return _twin_encoding(tokenizer, text, add_special_tokens)


def plain_prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as a whole prompt: what the tokenizer adds around any text (a bos), and the text
    with no control id parsed from it."""
    if _has_backend(tokenizer):
        return plain_encoding(tokenizer, text, add_special_tokens=True).ids
    head, tail = _added_around(tokenizer)
    return head + _python_plain_ids(tokenizer, text) + tail


def mixed_ids(tokenizer, parts: Sequence[Part]) -> list[int]:
    """The ids of the parts joined: the control tokens of the template's parts stay, the user
    parts give none. Without a control string in the user parts, the ids of the joined text."""
    if not _has_backend(tokenizer):
        return _python_mixed_ids(tokenizer, parts)
    text = "".join(t for t, _ in parts)
    user = _user_spans(parts)
    ordinary = _encode(tokenizer, text, False)
    found = parsed_controls(tokenizer, ordinary)
    if not any(_overlaps(ordinary.offsets[i], user) for i in found):
        return ordinary.ids
    ids: list[int] = []
    at = 0
    for i in found:  # the template's own control tokens cut the text; what lies between is plain
        start, end = ordinary.offsets[i]
        if _overlaps((start, end), user):
            continue
        ids += _twin_encoding(tokenizer, text[at:start], False).ids + [ordinary.ids[i]]
        at = end
    return ids + _twin_encoding(tokenizer, text[at:], False).ids


def parsed_controls(tokenizer, encoding: PlainEncoding) -> list[int]:
    """Positions of the control ids in `encoding` that stand for text (an added bos or eos
    covers none: the post-processor put it there, no string did)."""
    ids = control_ids(tokenizer)
    return [n for n, (i, (start, end)) in enumerate(zip(encoding.ids, encoding.offsets)) if i in ids and end > start]


def parsed_control_strings(tokenizer, text: str) -> list[str]:
    """The strings of `text` its ordinary tokenization turns into control tokens (first seen first)."""
    controls = _controls(tokenizer)
    if controls.literal and not any(s in text for s in controls.strings):
        return []  # no control string in it: nothing to tokenize (a store check reads every passage)
    encoding = _encode(tokenizer, text, False)
    found = [text[slice(*encoding.offsets[n])] for n in parsed_controls(tokenizer, encoding)]
    return list(dict.fromkeys(found))


def _controls(tokenizer) -> _Controls:
    key = (len(tokenizer), tuple(tokenizer.all_special_ids))
    try:
        known = _BY_TOKENIZER.get(tokenizer)
    except TypeError:  # an object no weak reference can point at: built on every call
        known = None
    if known is None or known.key != key:
        added = tokenizer.added_tokens_decoder
        markup = {i: t for i, t in added.items() if t.special or not t.content.isspace()}
        strings = {t.content for t in markup.values()} | set(tokenizer.all_special_tokens)
        literal = all(not t.normalized for t in markup.values()) or _normalizer(tokenizer) is None
        known = _Controls(key, frozenset(markup) | frozenset(key[1]), tuple(sorted(strings, key=len, reverse=True)),
                          literal)
        try:
            _BY_TOKENIZER[tokenizer] = known
        except TypeError:
            pass
    return known


def _normalizer(tokenizer):
    """The Rust normalizer; a Python tokenizer counts as one that normalizes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.normalizer if backend is not None else True


def _has_backend(tokenizer) -> bool:
    return bool(getattr(tokenizer, "is_fast", False)) and getattr(tokenizer, "backend_tokenizer", None) is not None


def _encode(tokenizer, text: str, add_special_tokens: bool) -> PlainEncoding:
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return PlainEncoding(list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]])


def _twin_encoding(tokenizer, text: str, add_special_tokens: bool) -> PlainEncoding:
    if not text and not add_special_tokens:
        return PlainEncoding([], [])
    enc = _twin(tokenizer).encode(text, add_special_tokens=add_special_tokens)
    result = PlainEncoding(list(enc.ids), [tuple(o) for o in enc.offsets])
    _check_plain(tokenizer, result)
    return result


def _twin(tokenizer):
    """A copy of the tokenizer's backend that reads its control tokens as text (built once per tokenizer)."""
    from tokenizers import Tokenizer

    controls = _controls(tokenizer)
    with controls.lock:
        if controls.twin is None:
            spec = json.loads(tokenizer.backend_tokenizer.to_str())
            for token in spec["added_tokens"]:  # dropping them would renumber the others (whitespace runs)
                token["special"] = token["special"] or token["id"] in controls.ids
            spec["truncation"] = spec["padding"] = None  # one text in, all of it out
            twin = Tokenizer.from_str(json.dumps(spec))
            twin.encode_special_tokens = True  # its own flag, set once: special tokens are text to it
            controls.twin = twin
        return controls.twin


def _check_plain(tokenizer, encoding: PlainEncoding) -> None:
    """No control id may come out of plain text; the unk id may (a character the vocabulary lacks)."""
    unk = tokenizer.unk_token_id
    left = [encoding.ids[n] for n in parsed_controls(tokenizer, encoding) if encoding.ids[n] != unk]
    if left:
        raise ModelLoadError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} makes control tokens "
            f"{tokenizer.convert_ids_to_tokens(left[:3])} out of plain text.",
            "Use a model whose tokenizer keeps control tokens out of its vocabulary's merges.")


def _user_spans(parts: Sequence[Part]) -> list[tuple[int, int]]:
    spans, at = [], 0
    for text, from_user in parts:
        if from_user and text:
            spans.append((at, at + len(text)))
        at += len(text)
    return spans


def _overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    start, end = span
    return any(start < b and end > a for a, b in spans)


def _python_plain_ids(tokenizer, text: str) -> list[int]:
    controls = control_ids(tokenizer) - {tokenizer.unk_token_id}  # unk: a character the vocabulary lacks
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not controls & set(ids):
        return ids
    ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    left = controls & set(ids)
    if left:  # split_special_tokens still parses non-special added tokens
        raise ModelLoadError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no fast (Rust) version, and its "
            f"added tokens {tokenizer.convert_ids_to_tokens(sorted(left)[:3])} cannot be kept out of text.",
            "Use a model that ships a tokenizer.json.")
    return ids


def _added_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a Python tokenizer's `add_special_tokens=True` puts before and after a text."""
    wrapped = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    for k in range(len(wrapped) - len(bare) + 1):
        if wrapped[k : k + len(bare)] == bare:
            return wrapped[:k], wrapped[k + len(bare):]
    raise ModelLoadError(f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} changes a text's own tokens "
                         "when it adds its special tokens.", "Use a model that ships a tokenizer.json.")


def _python_mixed_ids(tokenizer, parts: Sequence[Part]) -> list[int]:
    """Without offsets: the joined text unless a user part holds a control string, else the
    parts one by one (the template's parsed, the user's plain)."""
    strings = control_strings(tokenizer)
    if not any(s in text for text, from_user in parts if from_user for s in strings):
        return list(tokenizer("".join(t for t, _ in parts), add_special_tokens=False)["input_ids"])
    return [i for text, from_user in parts if text
            for i in (_python_plain_ids(tokenizer, text) if from_user else
                      tokenizer(text, add_special_tokens=False)["input_ids"])]
