"""A file of named numpy arrays that opens as zero-copy views, and string columns for it.

Layout: MAGIC, a little-endian u64 header length, a JSON header
`{name: [numpy dtype str, shape, offset]}`, then each array's C-order bytes
at that 64-byte-aligned offset past the header. Strings are stored as one
UTF-8 blob joined by NUL (split once on load), so NUL is refused in them.
"""

from __future__ import annotations

import json

import numpy as np

from cachegraft_cli.errors import UsageError

MAGIC = b"CGROWS1\n"
_ALIGN = 64
SEP = "\0"


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """The file's bytes (see the module docstring)."""
    layout: dict[str, list] = {}  # name -> [dtype, shape, byte offset]
    starts: dict[str, int] = {}
    offset = 0
    for name, a in arrays.items():
        layout[name] = [a.dtype.str, list(a.shape), offset]
        starts[name] = offset
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    header = json.dumps(layout).encode()
    body = bytearray(offset)
    for name, a in arrays.items():
        body[starts[name]:starts[name] + a.nbytes] = np.ascontiguousarray(a).tobytes()
    return MAGIC + len(header).to_bytes(8, "little") + header + bytes(body)


def unpack_arrays(blob: bytes) -> dict[str, np.ndarray]:
    """Read-only views into `blob`."""
    if blob[:len(MAGIC)] != MAGIC:
        raise ValueError("not a packed-array file (bad magic)")
    size = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "little")
    base = len(MAGIC) + 8 + size
    layout = json.loads(blob[len(MAGIC) + 8:base])
    out = {}
    for name, (dtype, shape, offset) in layout.items():
        count = int(np.prod(shape, dtype=np.int64))
        out[name] = np.frombuffer(blob, dtype=np.dtype(dtype), count=count, offset=base + offset).reshape(shape)
    return out


def join_strings(strings: list[str], what: str) -> np.ndarray:
    if any(SEP in s for s in strings):
        raise UsageError(f"a passage {what} contains a NUL character.", f"Remove NUL characters from passage {what}s.")
    return np.frombuffer(SEP.join(strings).encode("utf-8"), dtype=np.uint8)


def split_strings(blob: np.ndarray, count: int) -> list[str]:
    return blob.tobytes().decode("utf-8").split(SEP) if count else []
