"""The attention seam: a model's layers call `Attention`; a backend owns the KV cache layout, builds the
step's metadata, writes K/V and attends. Backends: `torch` (CPU, and the reference); more plug in by name."""
from aserve.attention.backend import AttentionBackend, BatchLayout, select_backend
from aserve.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "BatchLayout", "select_backend"]
