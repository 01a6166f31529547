"""Progress bars on stderr (tqdm)."""

from __future__ import annotations


class EncodeProgress:
    """Passages done, tokens/s and ETA; use as a context manager and call with (passages, tokens).

    The bar appears once there is work to show (`set_total`, or the first call), so
    a run refused at its checks prints only its error."""

    def __init__(self, total: int, desc: str = "encode"):
        self.total, self.desc, self.tokens = total, desc, 0
        self.bar = None

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
        """The number of chunks to encode, once the plan knows it (stored ones are not counted)."""
        self.total = total
        self._open().reset(total=total)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
