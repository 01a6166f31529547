"""Request bodies -> checked questions and ask options (no torch here).

A body fails with a `RequestError` naming the field and what it must be; the HTTP layer
turns it into OpenAI's error shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.errors import UsageError
from cachegraft_cli.lm.sampling import GenerationOptions


class RequestError(UsageError):
    """A request the server will not run: `status` is the HTTP code, `param` the field."""

    def __init__(self, message: str, hint: str = "", status: int = 400, param: str | None = None,
                 code: str = "invalid_request"):
        super().__init__(message, hint)
        self.status, self.param, self.code = status, param, code

    def __reduce__(self):
        return (type(self), (self.message, self.hint, self.status, self.param, self.code))


# The ask options a request may set, with the JSON types each takes.
_INT, _NUMBER, _STR = (int,), (int, float), (str,)
ASK_FIELDS: dict[str, tuple[type, ...]] = {
    "system": _STR, "k": _INT, "scheme": _STR, "order": _STR, "recompute": _INT, "blend": _NUMBER,
    "blend_layer": _INT, "max_new_tokens": _INT, "temperature": _NUMBER, "top_p": _NUMBER, "seed": _INT,
}
_GENERATION = {"max_new_tokens", "temperature", "top_p", "seed"}
# Below this a nucleus keeps only the likeliest token for any vocabulary under a million (that
# token has p >= 1/vocab), so nothing is lost; far below it float32 rounds top_p to 0, keeps no
# token and sampling divides by zero.
MIN_TOP_P = 1e-6
MAX_NAME_CHARS = 4096  # a store path or model name; the longest path Linux takes


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_k: int = 20
    max_new_tokens: int = 512
    max_body: int = 1 << 20  # bytes
    max_question_chars: int = 8192


@dataclass(frozen=True)
class Question:
    """One checked request: which store, the question, the options to answer it with."""

    store: str | None
    question: str
    options: AskOptions


def field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None, nullable: bool = False) -> Any:
    """`body[name]` if it has one of `kinds` (booleans are not numbers), else a RequestError."""
    value = body.get(name, default)
    if value is None and (nullable or name not in body):
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join("integer" if k is int else "number" if k is float else k.__name__ for k in kinds)
        article = "an" if names[0] in "aeiou" else "a"
        raise RequestError(f"'{name}' must be {article} {names}, not {json_kind(value)}.", param=name,
                           code="invalid_type")
    if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses to inf
        raise RequestError(f"'{name}' must be a finite number, got {value}.", param=name, code="invalid_number")
    return value


def name_field(body: dict, name: str) -> str | None:
    """`body[name]` naming a store or model: a string that a path can hold (no NUL or other
    control character: the OS refuses them with errors of its own), or None if absent."""
    value = field(body, name, _STR)
    if value is None:
        return None
    if len(value) > MAX_NAME_CHARS or any(ord(c) < 32 or c == "\x7f" for c in value):
        raise RequestError(f"'{name}' is not a name this server could serve: it holds a control character "
                           f"or is over {MAX_NAME_CHARS} characters.", "GET /v1/models lists the names.",
                           param=name, code="invalid_name")
    return value


def check_text(body: Any) -> None:
    """Refuse a body with a string (or key) that is not UTF-8 text: a lone surrogate (a JSON
    "\\ud800" escape) cannot be encoded, tokenized, logged or echoed back. Walked without
    recursion: a body may nest as deep as the JSON parser allowed."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack += list(value.keys()) + list(value.values())
        elif isinstance(value, list):
            stack += value
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RequestError(f"The body holds a lone surrogate ({value[exc.start]!r}): not UTF-8 text.",
                                   "Send UTF-8 text; \\ud800-\\udfff escapes must come in pairs.",
                                   code="invalid_text") from None


def json_kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def options_from_body(base: AskOptions, body: dict, limits: Limits,
                      aliases: dict[str, str] | None = None) -> AskOptions:
    """`base` with the ask options `body` sets (under their own names or `aliases`), checked."""
    values: dict[str, Any] = {}
    for alias, name in {**{n: n for n in ASK_FIELDS}, **(aliases or {})}.items():
        if alias in body and body[alias] is not None:
            values[name] = field(body, alias, ASK_FIELDS[name])
    generation = replace(base.generation, **{k: v for k, v in values.items() if k in _GENERATION})
    options = replace(base, **{k: v for k, v in values.items() if k not in _GENERATION}, generation=generation)
    check_limits(options, limits)
    try:
        options.check()
    except UsageError as exc:
        raise RequestError(exc.message, exc.hint) from None
    return options


def option_fields(options: AskOptions) -> dict[str, Any]:
    """The request fields that carry `options` (what `options_from_body` reads back)."""
    g = options.generation
    return {"system": options.system, "k": options.k, "scheme": options.scheme, "order": options.order,
            "recompute": options.recompute, "blend": options.blend, "blend_layer": options.blend_layer,
            "max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p, "seed": g.seed}


def check_limits(options: AskOptions, limits: Limits) -> None:
    g: GenerationOptions = options.generation
    if not 1 <= options.k <= limits.max_k:
        raise RequestError(f"k must be between 1 and {limits.max_k}, got {options.k}.",
                           "This server's limit is its --max-k.", param="k", code="k_out_of_range")
    if not 1 <= g.max_new_tokens <= limits.max_new_tokens:
        raise RequestError(f"max_tokens must be between 1 and {limits.max_new_tokens}, got {g.max_new_tokens}.",
                           "This server's limit is its --max-tokens.", param="max_tokens")
    if g.temperature < 0:
        raise RequestError(f"temperature must be at least 0, got {g.temperature}.", param="temperature")
    if not MIN_TOP_P <= g.top_p <= 1:
        raise RequestError(f"top_p must be from {MIN_TOP_P:g} to 1, got {g.top_p}.",
                           f"Any top_p up to {MIN_TOP_P:g} keeps only the likeliest token.", param="top_p")


def parse_question(question: Any, limits: Limits, param: str = "question") -> str:
    """A request's question (its `param` field) as text, or a 400 naming what is wrong with it."""
    if not isinstance(question, str):
        raise RequestError(f"'{param}' must be a string, not {json_kind(question)}.", param=param, code="invalid_type")
    if not question.strip():
        raise RequestError("The question is empty.", "Send the question as text.", param=param,
                           code="missing_question")
    if len(question) > limits.max_question_chars:
        raise RequestError(f"The question is {len(question)} characters; the limit is {limits.max_question_chars}.",
                           "Ask a shorter question.", param=param)
    return question


def ask_request(body: Any, base: AskOptions, limits: Limits) -> Question:
    """The body of `POST /v1/ask`: {"question", "store"?, and any of `ASK_FIELDS`}, as `ask --json` takes them."""
    body = _object(body)
    _refuse_unknown(body, {"question", "store", *ASK_FIELDS})
    if "question" not in body:
        raise RequestError("The request has no 'question'.", 'Send {"question": "..."}.', param="question",
                           code="missing_question")
    question = parse_question(body["question"], limits)
    store = name_field(body, "store")
    return Question(store, question, options_from_body(base, body, limits))


def retrieve_request(body: Any, base: AskOptions, limits: Limits) -> Question:
    """The body of `POST /v1/retrieve`: {"question", "store"?, "k"?}."""
    body = _object(body)
    _refuse_unknown(body, {"question", "store", "k"})
    if "question" not in body:
        raise RequestError("The request has no 'question'.", 'Send {"question": "..."}.', param="question",
                           code="missing_question")
    question = parse_question(body["question"], limits)
    return Question(name_field(body, "store"), question, options_from_body(base, {"k": body.get("k")}, limits))


@dataclass(frozen=True)
class Chat:
    """A checked `POST /v1/chat/completions` body."""

    model: str | None
    question: Question
    stream: bool


_CHAT_KNOWN = {"model", "messages", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
               "n", "stream_options", "user", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
               "k", "system", "scheme", "order", "recompute", "blend", "blend_layer"}


def chat_request(body: Any, base: AskOptions, limits: Limits) -> Chat:
    """OpenAI's chat body: the last user message is the question; `model` is resolved later
    (a store, a system, or STORE/SYSTEM). Sampling fields map onto the ask options; CacheGraft's
    own (k, order, ...) may come as extra fields. Fields OpenAI has that change nothing here are
    accepted; `n` other than 1 is refused."""
    body = _object(body)
    _refuse_unknown(body, _CHAT_KNOWN)
    model = name_field(body, "model")
    if field(body, "n", _INT, 1) != 1:
        raise RequestError("Only n=1 is supported.", "Leave n out.", param="n")
    question = last_user_message(body.get("messages"), limits)
    aliases = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
    options = options_from_body(base, body, limits, aliases)
    stream = field(body, "stream", (bool,), False)
    return Chat(model, Question(None, question, options), stream)


def last_user_message(messages: Any, limits: Limits) -> str:
    if messages is None:
        raise RequestError("The request has no 'messages'.", 'Send "messages": [{"role": "user", "content": "..."}].',
                           param="messages", code="missing_question")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("'messages' must be an array of objects.", param="messages", code="invalid_type")
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        raise RequestError("No user message in 'messages': the last one is the question.",
                           'Add {"role": "user", "content": "your question"}.', param="messages",
                           code="missing_question")
    return parse_question(_text(users[-1].get("content")), limits, "messages")


def _text(content: Any) -> Any:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(p for p in parts if isinstance(p, str)) if parts else content
    return content


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"The request body must be a JSON object, not {json_kind(body)}.", code="invalid_body")
    check_text(body)
    return body


def _refuse_unknown(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"Unknown field(s): {', '.join(unknown)}.", f"Known: {', '.join(sorted(known))}.",
                           param=unknown[0], code="unknown_field")
