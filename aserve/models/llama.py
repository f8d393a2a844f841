"""Llama (also Mistral, SmolLM): pre-norm decoder blocks of grouped-query attention with rotary
positions and a SwiGLU MLP. Qwen2 and Qwen3 are the same block with QKV bias or q/k RMSNorm.

Every layer's attention goes through the attention seam (aserve.attention) over the paged KV cache. Q/K/V
and gate/up projections are fused into one matmul each; `load_weights` stacks the checkpoint's separate
weights into them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from aserve.attention import Attention
from aserve.models import parallel
from aserve.models.flat_forward import UNBUILT, FlatForward, FlatLayer, native_projection
from aserve.models.interface import ModelShape, fill_from_checkpoint, need
from aserve.models.layers import Linear, RMSNorm, RotaryEmbedding, activation, rope_parameters
from aserve.quantization.base import NativeProjection


LAYER_NAME = re.compile(r"layers\.(\d+)\.")


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
    sliding_window: int | None = None  # Mistral, Phi-3: every layer attends to the last `sliding_window` positions
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0  # Phi-3: the share of each head's features that rotate

    @classmethod
    def from_config(cls, config: dict, **overrides) -> "ModelArgs":
        hidden, heads = need(config, "hidden_size"), need(config, "num_attention_heads")
        theta, scaling = rope_parameters(config)
        bias = bool(config.get("attention_bias", False))
        args = dict(
            vocab_size=need(config, "vocab_size"), hidden_size=hidden,
            intermediate_size=need(config, "intermediate_size"), num_layers=need(config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads, rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 2048), rope_theta=theta,
            rope_scaling=scaling, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=config.get("hidden_act") or config.get("hidden_activation") or "silu",
            partial_rotary_factor=float(scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))))
        args.update(overrides)
        if args["num_heads"] % args["num_kv_heads"]:
            raise ValueError(f"config.json: num_attention_heads ({args['num_heads']}) must be a multiple of "
                             f"num_key_value_heads ({args['num_kv_heads']})")
        return cls(**args)


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs, sliding_window: int | None = None, scale: float | None = None,
                 logit_softcap: float | None = None):
        super().__init__()
        tp, D = parallel.current(), args.head_dim
        heads = parallel.head_part(args.num_heads, args.num_kv_heads, tp)  # all of them at one rank
        self.q_size, self.kv_size = heads.num_q * D, heads.num_kv * D
        q_part, kv_part = (heads.q_start * D, self.q_size), (heads.kv_start * D, self.kv_size)
        full = [args.num_heads * D, args.num_kv_heads * D, args.num_kv_heads * D]  # q | k | v in the checkpoint
        self.qkv_proj = parallel.column_parallel(args.hidden_size, full, bias=args.qkv_bias, tp=tp,
                                                 parts=[q_part, kv_part, kv_part])
        self.o_proj = parallel.row_parallel(args.num_heads * D, args.hidden_size, bias=args.o_bias, tp=tp)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(heads.num_q, heads.num_kv, args.head_dim, scale or args.head_dim ** -0.5,
                              sliding_window=sliding_window, logit_softcap=logit_softcap)

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, meta):
        T, a = x.shape[0], self.attn
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, a.num_heads, a.head_dim)
        k = k.view(T, a.num_kv_heads, a.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        return self.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        tp = parallel.current()
        self.intermediate_size = args.intermediate_size // tp.size  # this rank's share of the inner features
        self.gate_up_proj = parallel.column_parallel(args.hidden_size, [args.intermediate_size] * 2,
                                                     bias=args.mlp_bias, tp=tp)
        self.down_proj = parallel.row_parallel(args.intermediate_size, args.hidden_size, bias=args.mlp_bias, tp=tp)
        self.act = activation(args.hidden_act)
        self.swiglu = args.hidden_act == "silu"

    def prepack(self, dtype: torch.dtype) -> bool:
        """A SwiGLU's gate | up packed for the GEMM's SiLU-and-mul epilogue where it can be (it runs before the
        layer would pack itself plainly: prepack_linears visits parents first)."""
        return self.swiglu and self.gate_up_proj.prepack(dtype, gated=True)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = SelfAttention(args, sliding_window=args.sliding_window)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, residual, positions, rope, kv_cache, meta):
        """(this layer's output before its residual add, the running sum): x + attn(norm(x)), then + mlp(norm(.)),
        with each add done by the norm that follows it (RMSNorm with a residual). residual is None at layer 0."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def flat_layer(self, dtype: torch.dtype) -> FlatLayer | None:
        """This layer as the flat forward runs it (models.flat_forward); None where it cannot (an MLP other than
        SwiGLU, or a part FlatLayer.of refuses)."""
        attn, mlp = self.self_attn, self.mlp
        if not mlp.swiglu:
            return None
        return FlatLayer.of(norm_in=self.input_layernorm, qkv_proj=attn.qkv_proj, q_size=attn.q_size,
                            kv_size=attn.kv_size, attn=attn.attn, q_norm=attn.q_norm, k_norm=attn.k_norm,
                            o_proj=attn.o_proj, norm_post=self.post_attention_layernorm,
                            gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (our parameter name piece, shard index in the fused weight)
    stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    supports_tensor_parallel = True  # built from models.parallel's layers (so are the families below it)
    supports_pipeline_parallel = True  # a stage builds only its layers (parallel.current_stage)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tp = tp = parallel.current()
        # a pipeline stage holds its own layers; the first embeds, the last has the norm and the head (and the
        # embedding too, as its head, when they are tied)
        self.stage = stage = parallel.current_stage()
        self.layer_range = stage.layers(args.num_layers)
        # a rank's KV cache holds its own KV heads only, of its own layers
        num_kv_heads = parallel.head_part(args.num_heads, args.num_kv_heads, tp).num_kv
        self.shape = ModelShape(len(self.layer_range), num_kv_heads, args.head_dim, args.vocab_size,
                                args.max_position_embeddings)
        self.embed_tokens = (parallel.embedding(args.vocab_size, args.hidden_size, tp)
                             if stage.first or (stage.last and args.tie_word_embeddings) else None)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in self.layer_range)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if stage.last else None
        self.lm_head = (parallel.lm_head(args.hidden_size, args.vocab_size, tp)
                        if stage.last and not args.tie_word_embeddings else None)
        self.rope: RotaryEmbedding | None = None
        self.packed_head: nn.Module | None = None
        self.flat = UNBUILT  # the straight-line CPU forward (models.flat_forward), built at the first step

    @classmethod
    def args_from_config(cls, config: dict) -> ModelArgs:
        return ModelArgs.from_config(config)

    @classmethod
    def from_config(cls, config: dict) -> "LlamaForCausalLM":
        return cls(cls.args_from_config(config))

    def prepare(self, max_positions: int, dtype: torch.dtype) -> None:
        a = self.args
        self.rope = RotaryEmbedding(a.head_dim, max(max_positions, a.max_position_embeddings), a.rope_theta,
                                    a.rope_scaling, dtype, rotary_dim=int(a.head_dim * a.partial_rotary_factor))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta, intermediate=None):
        """The hidden states after the final norm; a pipeline stage before the last takes `intermediate` from the
        stage before it (the first: nothing) and returns its own: (the last layer's output, the running sum)."""
        if self.flat is UNBUILT:  # at the first step, once the weights are loaded and packed
            self.flat = FlatForward.build(self)
        if self.flat is not None and FlatForward.takes(meta):  # the ops below, without per-op checks (flat_forward)
            return self.flat(input_ids, positions, kv_caches, meta, intermediate)
        x, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.rope, kv_cache, meta)
        if not self.stage.last:
            return x, residual
        return self.norm(x, residual)[0]

    def decode_steps(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                     contexts: torch.Tensor, kv_caches, backend, uniforms: torch.Tensor | None = None,
                     temperatures: torch.Tensor | None = None, drawn: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
        """Decode steps of decode rows in one call (FlatForward.decode_steps): [steps, rows] tokens, or None where
        the flat forward's C++ stack cannot run them."""
        if self.flat is UNBUILT or self.flat is None:
            return None
        return self.flat.decode_steps(token_ids, positions, slots, tables, contexts, kv_caches, backend, uniforms,
                                      temperatures, drawn)

    def native_head(self) -> NativeProjection | None:
        """compute_logits as the C++ stack's projection; None where it is not one of its kernels, or where a
        subclass's logits are more than the projection (Gemma 2 soft-caps them)."""
        if type(self).compute_logits is not LlamaForCausalLM.compute_logits or self.tp.size != 1:
            return None
        head = self.packed_head if self.packed_head is not None else self.lm_head
        return None if head is None else native_projection(head)

    def flat_layers(self, dtype: torch.dtype) -> list[FlatLayer] | None:
        """Every layer as the flat forward runs it; None unless all are this Llama block and it can run each."""
        if any(type(layer) is not DecoderLayer for layer in self.layers):
            return None
        layers = [layer.flat_layer(dtype) for layer in self.layers]
        return None if any(layer is None for layer in layers) else layers

    num_labels = 0  # a *ForSequenceClassification checkpoint: its labels (add_classifier)

    def add_classifier(self, num_labels: int) -> None:
        """Make this a classifier or reranker (*ForSequenceClassification): a `score` projection of the pooled
        last-token state onto `num_labels` logits, where a causal LM has its head."""
        self.num_labels = num_labels
        self.score = Linear(self.args.hidden_size, num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] last-token states -> [N, num_labels] logits."""
        return self.score(pooled)

    def output_weight(self) -> torch.Tensor | None:
        """The logits projection: the embedding when tied; None on a pipeline stage before the last."""
        if not self.stage.last:
            return None
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T, vocab] logits; with tensor parallelism on rank 0 only (None on the others, which do not sample)."""
        if self.packed_head is not None:  # the tied head's own copy: packed (ops.cpu_gemm) or quantized
            logits = self.packed_head(hidden)
        elif self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        return self.tp.gather_logits(logits, self.args.vocab_size)

    # -- loading Hugging Face checkpoints ---------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # the fused layers' shard sizes as this rank holds them (all of each at one rank)
        fused = {f"{prefix}.{name}": module.output_sizes for prefix, module in self.named_modules()
                 if isinstance(module, Linear) and len(module.output_sizes) > 1
                 for name, _ in module.named_parameters(recurse=False)}
        fill_from_checkpoint(self, weights, self.checkpoint_name, fused)

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter name (and fused shard) for a checkpoint tensor name; None to skip it."""
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb.inv_freq" in name:
            return None
        layer = LAYER_NAME.match(name)
        if layer is not None:  # a pipeline stage holds its own layers, numbered from 0
            index = int(layer.group(1))
            if index not in self.layer_range:
                return None
            name = f"layers.{index - self.layer_range.start}.{name[layer.end():]}"
        elif ((name.startswith("embed_tokens.") and self.embed_tokens is None)
              or (name.startswith("norm.") and self.norm is None)):
            return None
        if name.startswith("lm_head.") and not self.stage.last:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the output projection
        for piece, (fused, shard) in self.stacked.items():
            if f".{piece}." in name:
                return name.replace(piece, fused), shard
        return name, None
