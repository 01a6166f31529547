"""CacheGraft: retrieval-augmented generation with fused (Cache-to-Cache) KV caches."""

__version__ = "0.1.0"
