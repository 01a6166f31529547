"""Argument checks shared by the Python API and the CLI, so one mistake gets one message.

Each check returns the value it accepted (normalised where that is harmless: a path as
`str`) or raises `UsageError` saying what was wrong and what to pass instead. `name` is how
the message names the argument: both spellings where they differ, e.g. "k (-k)".
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from cachegraft_cli.errors import UsageError


def _got(value: Any) -> str:
    """The refused value as a message shows it: short, with its type when that is the mistake."""
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return shown if isinstance(value, (int, float, str)) and not isinstance(value, bool) else \
        f"{shown} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite int or float, not a bool. An int is never converted to float (math.isfinite(10**400)
    raises OverflowError): ints compare with any bound exactly."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def whole(name: str, value: Any, low: int, high: int | None = None) -> int:
    """A whole number (not a bool, not a float such as 1.5 or 3.0) from `low` to `high`."""
    if _is_int(value) and value >= low and (high is None or value <= high):
        return value
    span = f"from {low:,} to {high:,}" if high is not None else f"of at least {low:,}"
    raise UsageError(f"{name} must be a whole number {span}; got {_got(value)}.",
                     f"Pass a whole number {span}.")


def optional_whole(name: str, value: Any, low: int, high: int | None = None) -> int | None:
    return None if value is None else whole(name, value, low, high)


def number(name: str, value: Any, low: float, high: float | None = None) -> float:
    """A finite real number (int or float, not a bool) from `low` to `high`, both included."""
    if _is_real(value) and value >= low and (high is None or value <= high):
        return value
    span = f"from {low:g} to {high:g}" if high is not None else f"of at least {low:g}"
    raise UsageError(f"{name} must be a number {span}; got {_got(value)}.", f"Pass a number {span}.")


def probability(name: str, value: Any) -> float:
    """A share above 0 and at most 1 (a nucleus `top_p`: 0 would keep no token)."""
    if _is_real(value) and 0 < value <= 1:
        return value
    raise UsageError(f"{name} must be a number above 0 and at most 1; got {_got(value)}.",
                     "Pass e.g. 0.9, or 1 to sample from every token.")


def unusable_character(value: str) -> str | None:
    """What makes `value` unusable as text, or None: a NUL (no path, C string or store id holds
    one), or a lone surrogate, which is what Python makes of bytes that are not UTF-8 (a Latin-1
    command-line argument, a JSON `\\ud800` escape) and which no file, tokenizer or UTF-8
    document can hold."""
    if "\0" in value:
        return f"a NUL character (\\x00) at character {value.index(chr(0)) + 1}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"a lone surrogate ({value[err.start]!r}, not UTF-8) at character {err.start + 1}"
    return None


def utf8(name: str, value: str) -> str:
    """`value` (a str) unless it holds a character no UTF-8 text can (see `unusable_character`)."""
    problem = unusable_character(value)
    if problem is None:
        return value
    raise UsageError(f"{name} holds {problem}.",
                     "Pass UTF-8 text: convert other encodings first (e.g. `iconv -t UTF-8`), and decode "
                     "bytes with .decode('utf-8') rather than 'surrogateescape'.")


def text(name: str, value: Any, example: str = "") -> str:
    """A string with something in it besides whitespace, all of it UTF-8 text (`utf8`)."""
    if isinstance(value, str) and value.strip():
        return utf8(name, value)
    what = "is empty" if isinstance(value, str) else f"must be a string; got {_got(value)}"
    raise UsageError(f"{name} {what}.", f"Pass a non-empty string{', e.g. ' + example if example else ''}.")


def optional_text(name: str, value: Any) -> str | None:
    return None if value is None else text(name, value)


_LIST_EXAMPLE = '["first", "second"]'


def listed(name: str, value: Any, example: str = "") -> list:
    """A list (or other iterable, read once), its items unchecked. A single string, bytes or a
    mapping is refused: iterating one would ask its characters or keys one by one."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise UsageError(f"{name} must be a list of strings; got {_got(value)}.",
                         f"Pass a list, e.g. {example or _LIST_EXAMPLE}.")
    return list(value)


def texts(name: str, value: Any, example: str = "") -> list[str]:
    """A list (or other iterable, read once) of non-empty strings (`listed`)."""
    items = listed(name, value, example)
    for i, item in enumerate(items):
        text(f"{name}[{i}]", item)
    return items


def flag(name: str, value: Any) -> bool:
    """True or False, not a truthy string such as 'no'."""
    if isinstance(value, bool):
        return value
    raise UsageError(f"{name} must be True or False; got {_got(value)}.", "Pass True or False.")


def location(name: str, value: Any) -> str:
    """A path or URL: a non-empty `str` or `os.PathLike` (None would become a directory named 'None')."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and "\0" in value:  # the OS would raise a raw ValueError on first use
        raise UsageError(f"{name} holds a NUL character (\\x00): no path or URL can; got {_got(value)}.",
                         "Pass the path without the NUL (check how it was built).")
    if isinstance(value, str) and value.strip():
        return value
    raise UsageError(f"{name} must be a path or URL; got {_got(value)}.",
                     "Pass a directory path (str or pathlib.Path) or a URL such as s3://bucket/store.")


def one_of(name: str, value: Any, choices: Iterable[str]) -> str:
    options = tuple(choices)
    if isinstance(value, str) and value in options:
        return value
    raise UsageError(f"Unknown {name} {_got(value)}.", f"Choose one of: {', '.join(options)}.")


def callback(name: str, value: Any) -> Any:
    """None or something callable."""
    if value is None or callable(value):
        return value
    raise UsageError(f"{name} must be a function or None; got {_got(value)}.", "Pass a callable, or leave it out.")


def instance(name: str, value: Any, kind: type, build: str) -> Any:
    """None or an instance of `kind`; `build` says how to make one."""
    if value is None or isinstance(value, kind):
        return value
    raise UsageError(f"{name} must be of type {kind.__name__}, not {type(value).__name__}.", build)
