"""Metadata is evidence, not truth: checks of a store's metadata against itself.

A store's bytes are decoded through three layers of metadata: the root `zarr.json`
(identity, codec, geometry, kinds, chunking, compressor), each segment's row table
(which checksum columns it holds: "kind/component") and commit record, and each array's
own `zarr.json` (data type, shape, chunking, codecs). A one-word edit to any of them
makes intact bytes decode as something else, and a checksum over the raw bytes cannot
see it (int8 and uint8 are the same bytes). So every reader and every maintenance tool
checks the layers against each other before it trusts them, and a contradiction is a
`StoreMetadataError` (exit 7) naming the field: never a verdict on the rows.

Segments written from now on also carry `decodes`, the decode spec they were written
with (`decode_spec`), in their commit record and manifest entry: a root edit that keeps
every array's shape (a codec with the same parts) still contradicts it.
"""

from __future__ import annotations

import json
import math

from cachegraft_cli.errors import StoreMetadataError
from cachegraft_cli.store.layout import FORMAT_VERSION, IDENTITY_KEYS, array_path, token_extent

DECODES = "decodes"  # the key of a segment's decode spec in its commit record and manifest entry
_ARRAY_FIELDS = ("data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs")


def _refuse(url: str, where: str, text: str) -> StoreMetadataError:
    return StoreMetadataError(
        f"store {url}: {where} {text}; the metadata contradicts the store, so nothing was read, changed or deleted.",
        hint=f"Restore that file from a backup (or undo the edit), then run `cachegraft store verify {url}`. "
             f"`cachegraft store repair {url}` rewrites a segment's array metadata only where the store's "
             "identity and its other segments agree on it.")


# ---------------------------------------------------------------- the root zarr.json


def check_meta(url: str, meta: dict) -> None:
    """The root metadata follows the schema (`StoreMetadataError` naming the first bad field)."""
    problem = meta_problem(meta)
    if problem:
        raise _refuse(url, "zarr.json", problem)


def meta_problem(meta) -> str | None:
    """Why the root metadata cannot describe a store (the first problem found), or None."""
    if not isinstance(meta, dict):
        return "attributes.cachegraft is not an object"
    version = meta.get("format_version", 1)
    if not _count(version) or not 1 <= version <= FORMAT_VERSION:
        return f"has format_version={version!r} (1 to {FORMAT_VERSION} is required)"
    identity = meta.get("identity")
    if not isinstance(identity, dict):
        return "has no identity object"
    missing = [k for k in IDENTITY_KEYS if k not in identity]
    if missing:
        return f"has an identity without {', '.join(missing)}"
    return _geometry_problem(identity["geometry"]) or _kinds_problem(meta.get("kinds")) \
        or _codec_problem(meta) or _chunking_problem(meta) or _compressor_problem(meta.get("compressor"))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _geometry_problem(geometry) -> str | None:
    if not isinstance(geometry, dict) or not all(_count(geometry.get(k)) and geometry[k] > 0
                                                 for k in ("layers", "kv_heads", "head_dim")):
        return f"has identity.geometry={geometry!r} (positive whole layers, kv_heads, head_dim are required)"
    return None


def _kinds_problem(kinds) -> str | None:
    if not isinstance(kinds, list) or "fused" not in kinds or len(set(map(str, kinds))) != len(kinds) \
            or not all(isinstance(k, str) and k and "/" not in k for k in kinds):
        return f"has kinds={kinds!r} (distinct names, 'fused' among them, are required)"
    return None


def _codec_problem(meta: dict) -> str | None:
    from cachegraft_cli.errors import UsageError
    from cachegraft_cli.store.codecs import get_codec

    params = meta.get("codec_params")
    if params is not None and not isinstance(params, dict):
        return f"has codec_params={params!r} (an object is required)"
    try:
        get_codec(meta["identity"]["codec"], meta["identity"]["geometry"], params, stored=True)
    except (UsageError, KeyError, TypeError, ValueError) as exc:
        return f"has identity.codec={meta['identity'].get('codec')!r} with codec_params={params!r}, " \
               f"which do not make a codec ({getattr(exc, 'message', exc)})"
    return None


def _chunking_problem(meta: dict) -> str | None:
    from cachegraft_cli.store.codecs import get_codec

    chunk, shard = meta.get("chunk_tokens"), meta.get("shard_tokens")
    if not isinstance(chunk, int) or not _count(chunk) or chunk < 1:
        return f"has chunk_tokens={chunk!r} (a whole number >= 1 is required)"
    strides = [c.stride for c in get_codec(meta["identity"]["codec"], meta["identity"]["geometry"],
                                           meta.get("codec_params"), stored=True).components()]
    if not isinstance(shard, int) or not _count(shard) or shard < 1 or shard % math.lcm(chunk, *strides):
        return f"has shard_tokens={shard!r} (a multiple of chunk_tokens={chunk} and of the codec's groups is required)"
    return None


def _compressor_problem(spec) -> str | None:
    from cachegraft_cli.store.layout import zarr_compressors

    try:
        zarr_compressors(spec, "int8")
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"has compressor={spec!r}, which no zarr codec reads"
    return None


# ---------------------------------------------------------------- segments: decode spec, row tables


def decode_spec(meta: dict, codec) -> dict:
    """What decoding a segment's bytes depends on, as stored in its commit record."""
    comps = [[c.name, c.dtype, c.stride, list(c.tail)] for c in codec.components()]
    return json.loads(json.dumps({"codec": meta["identity"]["codec"], "codec_params": codec.params,
                                  "geometry": meta["identity"]["geometry"], "kinds": list(meta["kinds"]),
                                  "components": comps, "chunk_tokens": meta["chunk_tokens"],
                                  "shard_tokens": meta["shard_tokens"], "compressor": meta["compressor"]}))


def check_entry(url: str, entry: dict, spec: dict) -> None:
    """A segment written with a decode spec must be read with the same one."""
    said = entry.get(DECODES)
    if said is None or said == spec:
        return
    differ = [k for k in spec if not isinstance(said, dict) or said.get(k) != spec[k]]
    field = differ[0] if isinstance(said, dict) and differ else DECODES
    raise _refuse(url, f"segment {entry['name']} was written with {field}={_show(_get(said, field))}, but zarr.json",
                  f"says {field}={_show(spec.get(field))}")


def check_table(url: str, table, kinds, components) -> None:
    """A row table's checksum columns name the kinds and codec parts its segment was written with."""
    if not len(table):
        return
    want = {f"{k}/{c.name}" for k in kinds for c in components}
    have = set(table.crc_columns)
    if have == want:
        return
    have_kinds = sorted({c.split("/", 1)[0] for c in have})
    field = "kinds" if have_kinds != sorted(kinds) else "identity.codec"
    raise _refuse(url, f"zarr.json says kinds={list(kinds)} and parts "
                       f"{sorted(c.name for c in components)}, but segment {table.segment}'s row table",
                  f"holds checksums of {sorted(have)} (the field that disagrees: {field})")


def _get(obj, key):
    return obj.get(key) if isinstance(obj, dict) else obj


def _show(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


# ---------------------------------------------------------------- arrays


class ArrayExpectation:
    """The metadata the writer gives each array of a store (one template per codec part)."""

    def __init__(self, store):
        self.store = store
        self._templates: dict[str, dict] = {}

    def template(self, comp) -> dict:
        if comp.name not in self._templates:
            from zarr.storage import MemoryStore

            from cachegraft_cli.store.segments import create_array_in

            arr = create_array_in(MemoryStore(), "x", self.store, comp)
            self._templates[comp.name] = _plain(arr.metadata.to_dict())
        return self._templates[comp.name]

    def metadata_bytes(self, comp, rows: int) -> bytes:
        """The array's zarr.json as the writer would have left it with `rows` rows."""
        from zarr.storage import MemoryStore

        from cachegraft_cli.store.segments import create_array_in

        files: dict = {}
        arr = create_array_in(MemoryStore(store_dict=files), "x", self.store, comp)
        arr.resize((rows,) + comp.tail)
        return files["x/zarr.json"].to_bytes()


def expected_rows(comp, entry: dict, table) -> tuple[int, int]:
    """(least, most) rows an array of `comp` may have: what its passages need, what its entry says."""
    ends = (table.offsets + table.tokens) if len(table) else []
    need = comp.rows(0, int(max(ends)) if len(ends) else 0)[1]
    return need, max(need, comp.rows(0, token_extent(entry))[1])


def array_problem(expect: ArrayExpectation, arr, comp, entry: dict, table, rows: bool = True) -> str | None:
    """Why an opened array's metadata contradicts the store (None when it agrees; `rows=False`:
    everything but its length, which the segment's own table and entry decide)."""
    have = _plain(arr.metadata.to_dict())
    want = expect.template(comp)
    for field in _ARRAY_FIELDS:
        if have.get(field) != want.get(field):
            return f"says {field}={_show(have.get(field))}, but the store's codec writes {_show(want.get(field))}"
    shape = list(have.get("shape") or [])
    if shape[1:] != list(comp.tail):
        return f"says shape={shape}, but the store's geometry and codec give rows of shape {list(comp.tail)}"
    least, most = expected_rows(comp, entry, table)
    if rows and not least <= shape[0] <= most:
        return f"says {shape[0]} rows, but its segment's passages need {least}" + \
            (f" and its entry {most}" if most != least else "")
    return None


def check_array(url: str, expect: ArrayExpectation, arr, comp, entry: dict, table, kind: str) -> None:
    problem = array_problem(expect, arr, comp, entry, table)
    if problem:
        raise _refuse(url, f"{array_path(entry['name'], kind, comp.name)}/zarr.json", problem)


def array_refusal(url: str, entry: dict, kind: str, comp, why: str) -> StoreMetadataError:
    """The error for an array whose zarr.json does not open at all."""
    return _refuse(url, f"{array_path(entry['name'], kind, comp.name)}/zarr.json", f"does not open ({why})")


def _plain(obj):
    """Tuples as lists, so that metadata compares by value whatever built it."""
    return json.loads(json.dumps(obj, default=str))
