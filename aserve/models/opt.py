"""OPT: a multi-head attention decoder with learned absolute positions, LayerNorm and a two-layer MLP
(ReLU by default). Most sizes normalise before each sublayer (`do_layer_norm_before`); OPT-350m normalises
after the residual sum instead and also embeds in a narrower `word_embed_proj_dim`, projected in and out.

Q/K/V are fused into one matmul; `load_weights` stacks the checkpoint's separate q/k/v_proj into it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from aserve.attention import Attention
from aserve.models.interface import ModelShape, fill_from_checkpoint, need
from aserve.models.layers import Linear, activation
from aserve.models.parallel import plain_embedding

POSITION_OFFSET = 2  # fairseq reserved the first two rows of the position table: position p uses row p + 2


@dataclass
class OPTArgs:
    vocab_size: int
    hidden_size: int
    ffn_dim: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    word_embed_proj_dim: int
    do_layer_norm_before: bool
    final_layer_norm: bool
    activation_function: str
    enable_bias: bool
    layer_norm_elementwise_affine: bool
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: dict) -> "OPTArgs":
        hidden, heads = need(config, "hidden_size"), need(config, "num_attention_heads")
        if hidden % heads:
            raise ValueError(f"config.json: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})")
        pre_norm = bool(config.get("do_layer_norm_before", True))
        return cls(
            vocab_size=need(config, "vocab_size"), hidden_size=hidden, ffn_dim=need(config, "ffn_dim"),
            num_layers=need(config, "num_hidden_layers"), num_heads=heads,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            word_embed_proj_dim=config.get("word_embed_proj_dim") or hidden, do_layer_norm_before=pre_norm,
            # checkpoints fine-tuned before transformers 4.20.1 have no final norm and say so
            final_layer_norm=pre_norm and not config.get("_remove_final_layer_norm", False),
            activation_function=config.get("activation_function", "relu"),
            enable_bias=bool(config.get("enable_bias", True)),
            layer_norm_elementwise_affine=bool(config.get("layer_norm_elementwise_affine", True)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)))


def layer_norm(args: OPTArgs) -> nn.LayerNorm:
    return nn.LayerNorm(args.hidden_size, elementwise_affine=args.layer_norm_elementwise_affine)


class SelfAttention(nn.Module):
    def __init__(self, args: OPTArgs):
        super().__init__()
        self.hidden_size = args.hidden_size
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = Linear(args.hidden_size, [args.hidden_size] * 3, bias=args.enable_bias)
        self.out_proj = Linear(args.hidden_size, args.hidden_size, bias=args.enable_bias)
        # the reference scales the projected query, not the scores; the same order keeps fp32 results equal
        self.attn = Attention(args.num_heads, args.num_heads, args.head_dim, 1.0)

    def forward(self, x, kv_cache, meta):
        q, k, v = self.qkv_proj(x).split(self.hidden_size, dim=-1)
        return self.out_proj(self.attn(q * self.scale, k, v, kv_cache, meta))


class DecoderLayer(nn.Module):
    def __init__(self, args: OPTArgs):
        super().__init__()
        self.pre_norm = args.do_layer_norm_before
        self.self_attn_layer_norm = layer_norm(args)
        self.self_attn = SelfAttention(args)
        self.final_layer_norm = layer_norm(args)
        self.fc1 = Linear(args.hidden_size, args.ffn_dim, bias=args.enable_bias)
        self.fc2 = Linear(args.ffn_dim, args.hidden_size, bias=args.enable_bias)
        self.act = activation(args.activation_function)

    def forward(self, x, kv_cache, meta):
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), kv_cache, meta)
            return x + self.mlp(self.final_layer_norm(x))
        x = self.self_attn_layer_norm(x + self.self_attn(x, kv_cache, meta))
        return self.final_layer_norm(x + self.mlp(x))

    def mlp(self, x):
        return self.fc2(self.act(self.fc1(x)))


class OPTForCausalLM(nn.Module):
    # checkpoint name piece -> shard index in the fused qkv_proj
    stacked = {"q_proj": 0, "k_proj": 1, "v_proj": 2}

    def __init__(self, args: OPTArgs):
        super().__init__()
        self.args = args
        self.shape = ModelShape(args.num_layers, args.num_heads, args.head_dim, args.vocab_size,
                                args.max_position_embeddings)
        self.embed_tokens = plain_embedding(args.vocab_size, args.word_embed_proj_dim)
        self.embed_positions = plain_embedding(args.max_position_embeddings + POSITION_OFFSET, args.hidden_size)
        projected = args.word_embed_proj_dim != args.hidden_size
        self.project_in = Linear(args.word_embed_proj_dim, args.hidden_size) if projected else None
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.final_layer_norm = layer_norm(args) if args.final_layer_norm else None
        self.project_out = Linear(args.hidden_size, args.word_embed_proj_dim) if projected else None
        self.lm_head = None if args.tie_word_embeddings else Linear(args.word_embed_proj_dim, args.vocab_size)
        self.packed_head: nn.Module | None = None

    @classmethod
    def from_config(cls, config: dict) -> "OPTForCausalLM":
        return cls(OPTArgs.from_config(config))

    def prepare(self, max_positions: int, dtype: torch.dtype) -> None:
        """Learned positions cannot be extended: refuse a max_model_len past the table."""
        if max_positions > self.args.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_positions}) exceeds the {self.args.max_position_embeddings} "
                             "learned positions of this model (config.json: max_position_embeddings)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, kv_cache, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def output_weight(self) -> torch.Tensor:
        """The logits projection: the embedding when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:  # the tied head's own copy: packed (ops.cpu_gemm) or quantized
            return self.packed_head(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return torch.nn.functional.linear(hidden, self.embed_tokens.weight)

    # -- loading Hugging Face checkpoints ---------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        h = self.args.hidden_size
        fused = {name: [h, h, h] for name, _ in self.named_parameters() if ".qkv_proj." in name}
        fill_from_checkpoint(self, weights, self.checkpoint_name, fused)

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter name (and fused shard) for a checkpoint tensor name; None to skip it."""
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the output projection
        for prefix in ("model.", "decoder."):  # OPTForCausalLM, or a bare OPTModel / OPTDecoder
            if name.startswith(prefix):
                name = name[len(prefix):]
        for piece, shard in self.stacked.items():
            if f".{piece}." in name:
                return name.replace(piece, "qkv_proj"), shard
        return name, None
