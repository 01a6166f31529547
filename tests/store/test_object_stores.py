"""Stores on object storage through fsspec: s3:// (s3fs, against the test's moto server on
localhost) and gs:// (gcsfs); listings are never answered from a stale cache."""

from __future__ import annotations

import numpy as np
import pytest
from store_support import fill, identity, prefix

from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.location import Location


def test_s3_listings_see_other_writers(s3_bucket):
    """Another process (here: another filesystem instance) adds a segment after we listed:
    garbage collection and existence checks must see it."""
    import fsspec

    bucket = s3_bucket
    url = f"s3://{bucket}/store"
    rng = np.random.default_rng(0)
    store = CacheStore.create(url, identity(), prefix(rng))
    fill(store, rng, range(2))
    listed = store.loc.list_names("segments")  # a listing s3fs would otherwise cache
    other = fsspec.filesystem("s3", skip_instance_cache=True)
    other.pipe_file(f"{bucket}/store/segments/orphan/rows.bin", b"half-written")
    assert set(store.loc.list_names("segments")) == set(listed) | {"orphan"}
    assert store.loc.exists("segments/orphan/rows.bin")
    fill(store, rng, range(2, 4))  # the writer's garbage collection deletes the unlisted segment
    assert not other.exists(f"{bucket}/store/segments/orphan/rows.bin")
    again = CacheStore.open(url)
    assert len(again) == 4 and again.verify()["ok"]


def test_gs_urls_go_through_gcsfs_without_listing_caches():
    pytest.importorskip("gcsfs")
    loc = Location.from_url("gs://some-bucket/store", {"token": "anon"})  # no request is made here
    assert type(loc.fs).__module__.startswith("gcsfs") and loc.root == "some-bucket/store"
    assert loc.fs.dircache.use_listings_cache is False
    assert Location.from_url("memory://x/store").storage_options == {}  # in-process filesystems keep their defaults


def test_file_urls_and_plain_paths_are_the_same_store(tmp_path):
    rng = np.random.default_rng(1)
    data = fill(CacheStore.create(f"file://{tmp_path}/s", identity(), prefix(rng)), rng, range(3))
    store = CacheStore.open(str(tmp_path / "s"))
    assert store.loc.local and sorted(store.ids()) == sorted(data)
    assert np.array_equal(store.read(["p1"])[0], data["p1"]["fused"]) and store.verify()["ok"]
