"""The attention layer a model holds: its heads, scale and variant (sliding window, soft-capping, or
bidirectional for encoder models), with the work done by whatever backend built this step's metadata."""
from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    # An FP8 KV cache's per-tensor scales (attention.kv_quant.set_scales); unused with a cache in the model's dtype.
    k_scale = 1.0
    v_scale = 1.0
    kv_scales_pending = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None, causal: bool = True):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # a query at position i sees keys at j > i - sliding_window
        self.logit_softcap = logit_softcap
        # False: an encoder's attention, every token of a prompt sees every other. The prompt is then scheduled
        # whole (it cannot be chunked: a token also sees the ones after it) and nothing is kept for later steps.
        self.causal = causal

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        """query [T, Hq * D], key/value [T, Hkv * D] -> [T, Hq * D]."""
        T = query.shape[0]
        out = meta.backend.forward(self, query.view(T, self.num_heads, self.head_dim),
                                   key.view(T, self.num_kv_heads, self.head_dim),
                                   value.view(T, self.num_kv_heads, self.head_dim), kv_cache, meta)
        return out.reshape(T, self.num_heads * self.head_dim)
