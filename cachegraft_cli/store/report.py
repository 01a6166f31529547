"""`CacheStore.info()`: what a store holds and what produced it."""

from __future__ import annotations

from cachegraft_cli.store.codecs import raw_bf16_bytes_per_token
from cachegraft_cli.store.lock import is_held, read_holder


def _segment_summary(entry: dict) -> dict:
    return {k: entry.get(k) for k in ("name", "rows", "tokens", "bytes", "committed", "run_info")}


def _passage_tokens(store) -> int:
    """Tokens of the stored passages before pruning (the stored tokens in an unpruned store)."""
    return sum(int(t.span_tokens.sum()) if t.span_tokens is not None else int(t.tokens.sum()) for t in store.tables)


def info(store) -> dict:
    ident = store.identity
    entries = store.segments
    tokens = sum(e["tokens"] for e in entries)
    per_kind = {k: sum((e.get("bytes") or {}).get(k, 0) for e in entries) for k in store.kinds}
    raw = raw_bf16_bytes_per_token(store.geometry)
    measured = {k: (b / tokens if tokens else None) for k, b in per_kind.items()}
    passage_tokens = _passage_tokens(store)
    return {
        "url": store.loc.url,
        "format_version": store.meta.get("format_version", 1),
        "codec": ident["codec"],
        "codec_params": store.codec.params,
        "kinds": list(store.kinds),
        "geometry": store.geometry,
        "models": {role: ident.get(role) for role in ("receiver", "sharer", "fuser")},
        "template": ident.get("template"),
        "position_scheme": ident.get("position_scheme"),
        "dtype": ident.get("dtype"),
        "prefix_tokens": len(store.prefix_token_ids),
        "passages": len(store),
        "rows": sum(e["rows"] for e in entries),
        "tokens": tokens,
        "bytes": {"total": sum(per_kind.values()), "per_kind": per_kind},
        "bytes_per_token": measured,
        "nominal_bytes_per_token": store.codec.nominal_bytes_per_token(),
        # kept once per store, not per token (the transform codec's calibration); None for other codecs
        "codec_tables": store.codec.tables(),
        "raw_bf16_bytes_per_token": raw,
        "ratio_to_raw_bf16": {k: (v / raw if v is not None else None) for k, v in measured.items()},
        "keep": store.keep,
        "passage_tokens": passage_tokens,
        # stored bytes over raw bf16 KV of every passage token (the pruned ones too): what pruning and the codec save
        "ratio_to_raw_bf16_full": {k: (b / (raw * passage_tokens) if passage_tokens else None)
                                   for k, b in per_kind.items()},
        "chunk_tokens": store.chunk_tokens,
        "shard_tokens": store.shard_tokens,
        "compressor": store.compressor,
        "segments": {"count": len(entries), "list": [_segment_summary(e) for e in entries]},
        "writer": read_holder(store.loc) if is_held(store.loc) else None,
        "quarantine": store.loc.list_names("quarantine"),  # repairs whose removals are kept (`repair --undo ID`)
    }
