"""BM25 tokens: lowercase words of 2+ word characters minus bm25s' English stopwords,
stemmed with PyStemmer when it is installed (a stemmed index refuses to load without it)."""

from __future__ import annotations

import re

from cachegraft_cli.errors import RetrievalIndexError

TOKEN = re.compile(r"(?u)\b\w\w+\b")


class Tokenizer:
    def __init__(self, stem: bool | None):
        self._stemmer = load_stemmer(required=bool(stem)) if stem is not False else None
        self.stemmer_name = "pystemmer-english" if self._stemmer else None
        from bm25s.stopwords import STOPWORDS_EN

        self._stopwords = frozenset(STOPWORDS_EN)

    def __call__(self, text: str) -> list[str]:
        words = [w for w in TOKEN.findall(text.lower()) if w not in self._stopwords]
        return self._stemmer.stemWords(words) if self._stemmer else words


def load_stemmer(required: bool):
    try:
        import Stemmer  # PyStemmer
    except ImportError:
        if required:
            raise RetrievalIndexError(
                "this BM25 index was built with stemming but PyStemmer is not installed",
                "Install it (pip install PyStemmer) or rebuild the index.",
            ) from None
        return None
    return Stemmer.Stemmer("english")
