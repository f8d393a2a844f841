"""Llama (also Mistral, SmolLM): pre-norm decoder blocks of grouped-query attention with rotary
positions and a SwiGLU MLP. Qwen2 and Qwen3 are the same block with QKV bias or q/k RMSNorm.

Every layer's attention goes through ops.attention.paged_attention over the paged KV cache. Q/K/V and
gate/up projections are fused into one matmul each; the loader stacks the checkpoint's separate weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aserve.models.layers import RMSNorm, RotaryEmbedding, rope_parameters
from aserve.ops.attention import AttentionMetadata, paged_attention, write_kv


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: dict, **overrides) -> "ModelArgs":
        def need(name):
            if name not in config:
                raise ValueError(f"config.json: required field {name!r} is missing")
            return config[name]

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        theta, scaling = rope_parameters(config)
        bias = bool(config.get("attention_bias", False))
        args = dict(
            vocab_size=need("vocab_size"), hidden_size=hidden, intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"), num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads, rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 2048), rope_theta=theta,
            rope_scaling=scaling, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)))
        args.update(overrides)
        if args["num_heads"] % args["num_kv_heads"]:
            raise ValueError(f"config.json: num_attention_heads ({args['num_heads']}) must be a multiple of "
                             f"num_key_value_heads ({args['num_kv_heads']})")
        return cls(**args)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.view(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, positions, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (our parameter name piece, shard index in the fused weight)
    stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None

    @classmethod
    def args_from_config(cls, config: dict) -> ModelArgs:
        return ModelArgs.from_config(config)

    def init_rope(self, max_positions: int, dtype: torch.dtype) -> None:
        a = self.args
        self.rope = RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rope, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)

    # -- loading Hugging Face checkpoints ---------------------------------------------------------

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter name (and fused shard) for a checkpoint tensor name; None to skip it."""
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the output projection
        for piece, (fused, shard) in self.stacked.items():
            if f".{piece}." in name:
                return name.replace(piece, fused), shard
        return name, None

    def shard_sizes(self, fused: str) -> list[int]:
        a = self.args
        if "qkv_proj" in fused:
            return [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        return [a.intermediate_size, a.intermediate_size]
