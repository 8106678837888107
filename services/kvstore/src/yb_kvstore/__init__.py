"""The kvstore: one host's KV block pool (DRAM slab and SSD tier) served over UCX."""

__version__ = "0.1.0"
