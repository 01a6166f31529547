"""`encode --compressor zstd|none`: a store made without compression holds the same caches
(only the bytes on disk differ), records its compressor, and appends keep it."""

import numpy as np
import pytest

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.local import encode_corpus
from cachegraft_cli.encoding.plan import EncodeOptions
from cachegraft_cli.errors import StoreMismatchError, UsageError
from cachegraft_cli.session import ModelChoice, ModelSession
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.target import Target

TEXT = "Harbor town was founded in 1820 by fishermen who built the first lighthouse on the northern cliffs."


def _passages(n, start=0):
    return [Passage(f"p{i}", f"Title {i}", f"{TEXT} Item {i}.") for i in range(start, start + n)]


@pytest.fixture(scope="module")
def session(tiny_dirs):
    return ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, None, device="cpu", dtype="float32"))


@pytest.mark.parametrize("codec", ["bf16", "int8", "k2v4"])
def test_an_uncompressed_store_holds_the_same_caches(session, tmp_path, codec):
    ids = [f"p{i}" for i in range(4)]
    stores = {}
    for name in ("zstd", "none"):
        url = str(tmp_path / name)
        encode_corpus(_passages(4), Target.open(url), session, EncodeOptions(codec=codec, compressor=name))
        stores[name] = CacheStore.open(url)
    info = {name: s.info() for name, s in stores.items()}
    assert info["none"]["compressor"] == {"name": "none"} and info["zstd"]["compressor"]["cname"] == "zstd"
    arrays = {name: [t for p in (tmp_path / name / "segments").rglob("zarr.json") if "sharding" in (t := p.read_text())]
              for name in stores}
    assert all('"blosc"' in a for a in arrays["zstd"]) and not any('"blosc"' in a for a in arrays["none"])
    if codec == "bf16":  # tiny models' chunks are too small for the others to gain from compression
        assert info["none"]["bytes"]["total"] > info["zstd"]["bytes"]["total"]
    for a, b in zip(stores["zstd"].read(ids), stores["none"].read(ids)):
        assert np.array_equal(a, b)
    assert all(s.verify()["ok"] for s in stores.values())  # every chunk and passage checksum holds


def test_appends_keep_the_store_compressor_and_refuse_another(session, tmp_path):
    url = str(tmp_path / "s")
    encode_corpus(_passages(2), Target.open(url), session, EncodeOptions(codec="bf16", compressor="none"))
    more = encode_corpus(_passages(3), Target.open(url), session, EncodeOptions())  # no --compressor: the store's
    assert more.added == 1 and CacheStore.open(url).compressor == {"name": "none"}
    with pytest.raises(StoreMismatchError, match="compressor='none'") as err:
        encode_corpus(_passages(4), Target.open(url), session, EncodeOptions(compressor="zstd"))
    assert "Leave --compressor out" in err.value.hint


def test_an_unknown_compressor_is_refused():
    with pytest.raises(UsageError, match="compressor"):
        EncodeOptions(compressor="gzip")
