"""Progress bars on stderr (tqdm)."""

from __future__ import annotations


class EncodeProgress:
    """Passages done, tokens/s and ETA; use as a context manager and call with (passages, tokens)."""

    def __init__(self, total: int, desc: str = "encode"):
        self.total, self.desc, self.tokens = total, desc, 0

    def __enter__(self):
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, unit="passage", desc=self.desc, dynamic_ncols=True)
        return self

    def __call__(self, passages: int, tokens: int) -> None:
        self.tokens += tokens
        elapsed = self.bar.format_dict.get("elapsed") or 1e-9
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(passages)

    def set_total(self, total: int) -> None:
        """The number of chunks to encode, once the plan knows it (stored ones are not counted)."""
        self.bar.reset(total=total)

    def __exit__(self, *exc):
        self.bar.close()
