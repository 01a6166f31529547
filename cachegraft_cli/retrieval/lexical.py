"""The BM25 part of an index: the tokenizer, its vocabulary and the appendable postings
(`cachegraft_cli.bm25`), saved as immutable blocks."""

from __future__ import annotations

import json

import numpy as np

from cachegraft_cli.errors import RetrievalIndexError
from cachegraft_cli.retrieval.files import (
    as_stream,
    load_npy,
    read_bytes,
    rebuild_hint,
    store_of,
    write_bytes,
    write_npy,
)
from cachegraft_cli.retrieval.tokens import Tokenizer


class Bm25Part:
    """The tokenizer, its vocabulary and the appendable BM25 postings (`cachegraft_cli.bm25`)."""

    def __init__(self, stem: bool | None, vocab: dict[str, int] | None = None, index=None):
        from cachegraft_cli.bm25 import Bm25

        self.tokenize = Tokenizer(stem)
        self.vocab: dict[str, int] = vocab or {}
        self.index = index or Bm25(terms=len(self.vocab))

    def count(self) -> int:
        return self.index.count()

    def set(self, row: int, text: str) -> None:
        self.index.add(row, [self.vocab.setdefault(t, len(self.vocab)) for t in self.tokenize(text)])

    def scores(self, query: str) -> np.ndarray:
        ids = [self.vocab[t] for t in self.tokenize(query) if t in self.vocab]
        return self.index.scores(ids, len(self.vocab))

    def save(self, fs, root: str) -> list[str]:
        """Blocks are immutable: only those not yet at `root` are written (the last
        array last). Returns the names of all blocks, for index.json."""
        import uuid

        from cachegraft_cli.bm25 import BLOCK_ARRAYS

        self.index.flush(len(self.vocab))
        write_bytes(fs, f"{root}/bm25_vocab.json", json.dumps(self.vocab).encode())
        for block in self.index.blocks:
            block.name = block.name or f"block-{uuid.uuid4().hex[:12]}"
            if fs.exists(f"{root}/bm25/{block.name}/{BLOCK_ARRAYS[-1]}.npy"):
                continue
            fs.makedirs(f"{root}/bm25/{block.name}", exist_ok=True)
            for name, array in block.arrays().items():
                write_npy(fs, f"{root}/bm25/{block.name}/{name}.npy", array)
        return [b.name for b in self.index.blocks]

    @classmethod
    def load(cls, fs, root: str, meta: dict) -> Bm25Part:
        """Blocks are memory-mapped when local. An index saved before blocks (one
        `bm25.npz`) is turned into one block from its token lists."""
        try:
            return cls._load(fs, root, meta)
        except FileNotFoundError as exc:
            raise RetrievalIndexError(f"{root}: BM25 file missing ({exc.filename or exc})",
                                      rebuild_hint(store_of(root))) from None

    @classmethod
    def _load(cls, fs, root: str, meta: dict) -> Bm25Part:
        from cachegraft_cli.bm25 import BLOCK_ARRAYS, Block, Bm25, build_block

        vocab = json.loads(read_bytes(fs, f"{root}/bm25_vocab.json"))
        names = meta.get("bm25_blocks")
        if names is None:
            arrays = np.load(as_stream(read_bytes(fs, f"{root}/bm25.npz")))
            tokens, offsets = arrays["tokens"], arrays["offsets"]
            docs = [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
            blocks = [build_block(docs, 0, len(vocab))]
        else:
            blocks = [Block(**{a: load_npy(fs, f"{root}/bm25/{n}/{a}.npy") for a in BLOCK_ARRAYS}, name=n)
                      for n in names]
        return cls(meta["stemmer"] is not None, vocab, Bm25(blocks, terms=len(vocab)))
