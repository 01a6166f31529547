"""The store contract (`store_suite.StoreTests`) on every URL kind a store can live at."""

from __future__ import annotations

import pytest
from store_suite import StoreTests
from store_support import memory_url


class TestLocalPath(StoreTests):
    @pytest.fixture
    def url(self, tmp_path):
        return str(tmp_path / "store")


class TestFileUrl(StoreTests):
    @pytest.fixture
    def url(self, tmp_path):
        return f"file://{tmp_path}/store"


class TestMemory(StoreTests):
    @pytest.fixture
    def url(self):
        return memory_url()


class TestS3(StoreTests):
    """On moto's S3 server on 127.0.0.1 (a real HTTP server), through s3fs."""

    @pytest.fixture
    def url(self, s3_bucket):
        return f"s3://{s3_bucket}/store"
