"""Cross-tokenizer alignment: one sharer token per receiver token.

The receiver's tokens define the positions. Each receiver token is decoded to
text and re-encoded with the sharer tokenizer (no special tokens; a text token as
plain text, so it cannot become a sharer control token): zero pieces
map to the sharer's unk (or 0), one piece to itself, several to the first
(`first`) or the one with the longest text (`longest`). Special tokens map by
role (bos/eos/pad/unk). Pairs with the same vocabulary need no alignment.
"""

from __future__ import annotations

from functools import lru_cache

from cachegraft_cli.errors import AlignmentError
from cachegraft_cli.lm.plaintext import control_ids, plain_ids

STRATEGIES = ("first", "longest")
_ROLES = ("bos", "eos", "pad", "unk")


def same_vocabulary(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


class TokenAligner:
    def __init__(self, receiver_tok, sharer_tok, strategy: str = "first"):
        if strategy not in STRATEGIES:
            raise AlignmentError(f"Unknown alignment strategy {strategy!r}.", f"Use one of {', '.join(STRATEGIES)}.")
        self.receiver_tok = receiver_tok
        self.sharer_tok = sharer_tok
        self.strategy = strategy
        self.identity = same_vocabulary(receiver_tok, sharer_tok)
        self._special = self._role_map()
        self.map_token = lru_cache(maxsize=None)(self._map_token)

    def align(self, ids: list[int]) -> list[int]:
        """Sharer ids, one per receiver id."""
        if self.identity:
            return list(ids)
        return [self.map_token(int(i)) for i in ids]

    def _role_map(self) -> dict[int, int]:
        out = {}
        for role in _ROLES:
            rid = getattr(self.receiver_tok, f"{role}_token_id", None)
            if rid is not None and rid not in out:
                out[rid] = self._sharer_role_id(role)
        return out

    def _sharer_role_id(self, role: str) -> int:
        for candidate in (role, "eos", "unk"):
            sid = getattr(self.sharer_tok, f"{candidate}_token_id", None)
            if sid is not None:
                return sid
        return 0

    def _map_token(self, rid: int) -> int:
        if rid in self._special:
            return self._special[rid]
        text = self.receiver_tok.decode([rid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pieces = self._sharer_pieces(rid, text) if text else []
        if not pieces:
            unk = self.sharer_tok.unk_token_id
            return unk if unk is not None else 0
        if len(pieces) == 1 or self.strategy == "first":
            return pieces[0]
        return max(pieces, key=lambda p: len(self.sharer_tok.decode([p], clean_up_tokenization_spaces=False)))

    def _sharer_pieces(self, rid: int, text: str) -> list[int]:
        """A receiver control token (the template's: passages never hold one) is the sharer's
        control token of that name where it has one; a text token is text to the sharer too,
        so it never becomes a sharer control token (`lm.plaintext`)."""
        if rid in control_ids(self.receiver_tok):
            return list(self.sharer_tok(text, add_special_tokens=False)["input_ids"])
        return plain_ids(self.sharer_tok, text)
