"""GPT-2: pre-norm decoder blocks of multi-head attention with learned absolute positions, LayerNorm and a
GELU MLP (tanh-approximate, `gelu_new`), the output projection tied to the token embedding.

The checkpoint stores its projections as Conv1D, weights [in, out], Q/K/V already fused in `c_attn`;
`load_weights` transposes them into ordinary [out, in] Linear weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from aserve.attention import Attention
from aserve.models.interface import ModelShape, ParamFiller, need
from aserve.models.layers import Linear, activation
from aserve.models.parallel import plain_embedding

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # the causal mask, saved as tensors by old checkpoints


@dataclass
class GPT2Args:
    vocab_size: int
    hidden_size: int
    inner_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_epsilon: float
    activation_function: str
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: dict) -> "GPT2Args":
        hidden, heads = need(config, "n_embd"), need(config, "n_head")
        if hidden % heads:
            raise ValueError(f"config.json: n_embd ({hidden}) must be a multiple of n_head ({heads})")
        if config.get("add_cross_attention"):
            raise ValueError("config.json: add_cross_attention is set; only decoder-only GPT-2 is supported")
        return cls(
            vocab_size=need(config, "vocab_size"), hidden_size=hidden, inner_size=config.get("n_inner") or 4 * hidden,
            num_layers=need(config, "n_layer"), num_heads=heads,
            max_position_embeddings=config.get("n_positions", 1024),
            layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
            activation_function=config.get("activation_function", "gelu_new"),
            scale_attn_weights=bool(config.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(config.get("scale_attn_by_inverse_layer_idx", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)))

    def attention_scale(self, layer: int) -> float:
        """1/sqrt(head_dim) when `scale_attn_weights`, and also 1/(layer + 1) when `scale_attn_by_inverse_layer_idx`
        (a stabiliser some checkpoints were trained with)."""
        scale = self.head_dim ** -0.5 if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale


class SelfAttention(nn.Module):
    def __init__(self, args: GPT2Args, layer: int):
        super().__init__()
        self.hidden_size = args.hidden_size
        self.c_attn = Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.c_proj = Linear(args.hidden_size, args.hidden_size, bias=True)
        self.attn = Attention(args.num_heads, args.num_heads, args.head_dim, args.attention_scale(layer))

    def forward(self, x, kv_cache, meta):
        q, k, v = self.c_attn(x).split(self.hidden_size, dim=-1)
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.c_fc = Linear(args.hidden_size, args.inner_size, bias=True)
        self.c_proj = Linear(args.inner_size, args.hidden_size, bias=True)
        self.act = activation(args.activation_function)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, args: GPT2Args, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.attn = SelfAttention(args, layer)
        self.ln_2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.mlp = MLP(args)

    def forward(self, x, kv_cache, meta):
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.shape = ModelShape(args.num_layers, args.num_heads, args.head_dim, args.vocab_size,
                                args.max_position_embeddings)
        self.wte = plain_embedding(args.vocab_size, args.hidden_size)
        self.wpe = plain_embedding(args.max_position_embeddings, args.hidden_size)
        self.h = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.ln_f = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size)
        self.packed_head: nn.Module | None = None

    @classmethod
    def from_config(cls, config: dict) -> "GPT2LMHeadModel":
        return cls(GPT2Args.from_config(config))

    def prepare(self, max_positions: int, dtype: torch.dtype) -> None:
        """Learned positions cannot be extended: refuse a max_model_len past the table."""
        if max_positions > self.args.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_positions}) exceeds the {self.args.max_position_embeddings} "
                             "learned positions of this model (config.json: n_positions)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta):
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, meta)
        return self.ln_f(x)

    def output_weight(self) -> torch.Tensor:
        """The logits projection: the embedding when tied."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:  # the tied head's own copy: packed (ops.cpu_gemm) or quantized
            return self.packed_head(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return torch.nn.functional.linear(hidden, self.wte.weight)

    # -- loading Hugging Face checkpoints ---------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        filler = ParamFiller(self)
        for name, tensor in weights:
            ours = self.checkpoint_name(name)
            if ours is None:
                continue
            if ours.endswith(CONV1D):  # say so, or a shape error would show shapes the file does not hold
                filler.fill(ours, tensor.t(), f"{name} (transposed: Conv1D stores [in, out])")
            else:
                filler.fill(ours, tensor, name)
        filler.check_complete()

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor name; None to skip it."""
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the output projection
        if name.startswith("transformer."):  # GPT2LMHeadModel; a bare GPT2Model has no prefix
            name = name[len("transformer."):]
        return None if name.endswith(MASK_BUFFERS) else name
