"""Gemma 2: a pre- and post-normed block (four RMSNorms with weights stored as offsets from one), a GeGLU
MLP, embeddings scaled by sqrt(hidden), query scale from `query_pre_attn_scalar`, attention logits and
final logits soft-capped (cap * tanh(x / cap)), and layers that alternate between a sliding window (even
layers, by default) and full attention."""
from __future__ import annotations

import torch
from torch import nn

from aserve.models.layers import OffsetRMSNorm
from aserve.models.llama import MLP, LlamaForCausalLM, ModelArgs, SelfAttention


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, sliding_window: int | None, scale: float, softcap: float | None):
        super().__init__()
        eps = args.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, eps)
        self.self_attn = SelfAttention(args, sliding_window=sliding_window, scale=scale, logit_softcap=softcap)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(args.hidden_size, eps)
        self.mlp = MLP(args)
        self.post_feedforward_layernorm = OffsetRMSNorm(args.hidden_size, eps)

    def forward(self, x, positions, rope, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs, config: dict):
        super().__init__(args)
        n = args.num_layers
        types = config.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        scale = float(config.get("query_pre_attn_scalar") or args.head_dim) ** -0.5
        window = config.get("sliding_window")
        softcap = config.get("attn_logit_softcapping")
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(args, window if types[i] == "sliding_attention" else None, scale, softcap)
            for i in self.layer_range)
        self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps) if self.stage.last else None
        self.final_softcap = config.get("final_logit_softcapping")
        self.embed_scale = args.hidden_size ** 0.5

    @classmethod
    def from_config(cls, config: dict) -> "Gemma2ForCausalLM":
        args = ModelArgs.from_config(config, tie_word_embeddings=True,
                                     hidden_act=config.get("hidden_activation") or "gelu_pytorch_tanh")
        return cls(args, config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta, intermediate=None):
        if intermediate is None:
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the model's dtype, as the reference
        else:
            (x,) = intermediate
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rope, kv_cache, meta)
        return self.norm(x) if self.stage.last else (x,)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is not None and logits is not None:  # None: a tensor-parallel rank other than 0
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
