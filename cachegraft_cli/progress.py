"""Progress on stderr: the encode bar (tqdm) and the status hook around model loads.

Library code says what it is doing with `loading("...")`; what that shows is up to
the caller (`reporting(...)`): the CLI shows a spinner on a TTY, a plain line
otherwise, or nothing under --json; a library user sees nothing unless they ask.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, Callable, Iterator

StatusFactory = Callable[[str], AbstractContextManager]
_status: ContextVar[StatusFactory | None] = ContextVar("cachegraft_status", default=None)


@contextmanager
def reporting(factory: StatusFactory | None) -> Iterator[None]:
    """Within this block, `loading(message)` enters `factory(message)`."""
    token = _status.set(factory)
    try:
        yield
    finally:
        _status.reset(token)


def loading(message: str) -> AbstractContextManager:
    """Context manager around a slow step (a model load): shows `message` while it runs, if asked to."""
    factory = _status.get()
    return factory(message) if factory is not None else nullcontext()


class EncodeProgress:
    """Passages done, tokens/s and ETA; use as a context manager and call with (passages, tokens).

    The bar appears on the first call (`encode_corpus` calls `(0, 0)` once the models are
    loaded), so loading time neither holds it at 0% nor counts in its rate, and a run
    refused at its checks prints only its error. `set_total` corrects the total once the
    plan knows it (chunks of long passages counted, stored ones not)."""

    def __init__(self, total: int, desc: str = "encode"):
        self.total, self.desc, self.tokens = total, desc, 0
        self.bar: Any = None  # the tqdm bar, once encoding starts

    def __enter__(self):
        return self

    def _open(self):
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="passage", desc=self.desc, dynamic_ncols=True)
        return self.bar

    def __call__(self, passages: int, tokens: int) -> None:
        bar = self._open()
        self.tokens += tokens
        elapsed = bar.format_dict.get("elapsed") or 1e-9
        bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        bar.update(passages)

    def set_total(self, total: int) -> None:
        """The number of chunks to encode, once the plan knows it (before the bar appears)."""
        self.total = total
        if self.bar is not None:
            self.bar.reset(total=total)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
