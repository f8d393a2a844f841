"""BERT, RoBERTa and XLM-RoBERTa: encoder-only stacks of post-norm blocks (attention, then a GELU MLP, each added
back and LayerNorm'd) over word + position + segment embeddings. The pooling runner serves them: as embedders
(`*Model`, and `*ForMaskedLM` with the MLM head left out) and, with their classification head, as classifiers and
cross-encoders (`*ForSequenceClassification`).

Attention is the shared Attention layer with causal=False: every prompt runs whole in one step and keeps nothing
in the KV cache. Two inputs that transformers takes beside the token ids are derived from them here:
- segment ids (BERT's token_type_ids): a pair is tokenized [CLS] a [SEP] b [SEP], so the second segment is what
  follows the first [SEP] (`sep_token_id`: config.json's, else the tokenizer's, set by the loader);
- positions: RoBERTa's count from padding_idx + 1 (pad_token_id + 1: 2 for RoBERTa and XLM-R), BERT's from 0.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from aserve.attention import Attention
from aserve.models.interface import ModelShape, fill_from_checkpoint, need
from aserve.models.layers import Linear, activation
from aserve.models.parallel import plain_embedding
from aserve.pooling.params import num_labels

# a layer's checkpoint name (after encoder.layer.N.) -> (ours, shard of the fused q|k|v)
LAYER_NAMES = {"attention.self.query": ("qkv", 0), "attention.self.key": ("qkv", 1),
               "attention.self.value": ("qkv", 2), "attention.output.dense": ("attention_output", None),
               "attention.output.LayerNorm": ("attention_norm", None), "intermediate.dense": ("intermediate", None),
               "output.dense": ("output", None), "output.LayerNorm": ("output_norm", None)}
LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")
SKIPPED = ("cls.", "lm_head.")  # the masked-LM heads of *ForMaskedLM checkpoints


@dataclass
class EncoderArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int  # RoBERTa: pad_token_id + 1; BERT: 0
    sep_token_id: int | None
    num_labels: int  # 0: no classification head

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: dict, roberta: bool, classifier: bool) -> "EncoderArgs":
        hidden, heads = need(config, "hidden_size"), need(config, "num_attention_heads")
        if hidden % heads:
            raise ValueError(f"config.json: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})")
        if config.get("is_decoder") or config.get("add_cross_attention"):
            raise ValueError("config.json: is_decoder / add_cross_attention is set; only encoders are supported")
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"config.json: position_embedding_type {kind!r} is not supported (absolute)")
        return cls(vocab_size=need(config, "vocab_size"), hidden_size=hidden,
                   num_layers=need(config, "num_hidden_layers"), num_heads=heads,
                   intermediate_size=need(config, "intermediate_size"),
                   max_position_embeddings=config.get("max_position_embeddings", 512),
                   type_vocab_size=config.get("type_vocab_size", 2), layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                   hidden_act=config.get("hidden_act", "gelu"),
                   position_offset=config.get("pad_token_id", 1) + 1 if roberta else 0,
                   sep_token_id=config.get("sep_token_id"), num_labels=num_labels(config) if classifier else 0)


class Embeddings(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.word_embeddings = plain_embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = plain_embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = plain_embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.position_offset = args.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
             + self.token_type_embeddings(segments))
        return self.LayerNorm(x)


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        h = args.hidden_size
        self.qkv = Linear(h, [h, h, h], bias=True)
        self.attn = Attention(args.num_heads, args.num_heads, args.head_dim, args.head_dim ** -0.5, causal=False)
        self.attention_output = Linear(h, h, bias=True)
        self.attention_norm = nn.LayerNorm(h, eps=args.layer_norm_eps)
        self.intermediate = Linear(h, args.intermediate_size, bias=True)
        self.act = args.hidden_act
        activation(args.hidden_act)  # refuse an unknown one at load
        self.output = Linear(args.intermediate_size, h, bias=True)
        self.output_norm = nn.LayerNorm(h, eps=args.layer_norm_eps)
        self.hidden_size = h

    def forward(self, x, kv_cache, meta):
        """Post-norm: LN(x + attention), then LN(x + MLP); the GELU runs in the GEMM's epilogue where the weights
        are packed, each residual add with its norm in one kernel (models.layers.Linear.forward_gelu /
        forward_add_norm)."""
        q, k, v = self.qkv(x).split(self.hidden_size, dim=-1)
        x = self.attention_output.forward_add_norm(self.attn(q, k, v, kv_cache, meta), x, self.attention_norm)
        return self.output.forward_add_norm(self.intermediate.forward_gelu(x, self.act), x, self.output_norm)


class BertModel(nn.Module):
    """The encoder; its classifier subclasses add the head. `num_labels` 0: an embedder (the runner pools the
    final hidden states); more: `classify` maps a pooled first-token state to the labels' logits."""
    roberta = False
    classifier = False

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.num_labels = args.num_labels
        self.sep_token_id = args.sep_token_id  # the loader sets the tokenizer's where config.json has none
        self.shape = ModelShape(args.num_layers, args.num_heads, args.head_dim, args.vocab_size,
                                args.max_position_embeddings - args.position_offset, causal=False)
        self.embeddings = Embeddings(args)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_layers))
        if args.num_labels:  # BERT's pooler (dense + tanh) then classifier; RoBERTa's classifier.dense + out_proj
            self.head_dense = Linear(args.hidden_size, args.hidden_size, bias=True)
            self.head_out = Linear(args.hidden_size, args.num_labels, bias=True)

    @classmethod
    def from_config(cls, config: dict) -> "BertModel":
        return cls(EncoderArgs.from_config(config, cls.roberta, cls.classifier))

    def prepare(self, max_positions: int, dtype: torch.dtype) -> None:
        """Learned positions cannot be extended: refuse a max_model_len past the table."""
        if max_positions > self.shape.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_positions}) exceeds the {self.shape.max_position_embeddings} "
                             "learned positions of this model (config.json: max_position_embeddings)")

    def segments(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's segment: 1 after its prompt's first [SEP], else 0 (every prompt is whole in the step, so
        position 0 starts one)."""
        if self.args.type_vocab_size < 2 or self.sep_token_id is None:
            return torch.zeros_like(input_ids)
        sep = (input_ids == self.sep_token_id).long()
        before = sep.cumsum(0) - sep  # [SEP]s before each token, over the whole flat batch
        starts = positions == 0
        prompt = starts.long().cumsum(0) - 1
        return (before - before[starts][prompt] > 0).long()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, self.segments(input_ids, positions))
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, kv_cache, meta)
        return x

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token states -> [N, num_labels] logits."""
        return self.head_out(torch.tanh(self.head_dense(pooled)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} is an encoder: it pools, it does not generate")

    # -- loading Hugging Face checkpoints ---------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        h = self.args.hidden_size
        fused = {f"layers.{i}.qkv.{p}": [h, h, h] for i in range(self.args.num_layers) for p in ("weight", "bias")}
        fill_from_checkpoint(self, weights, self.checkpoint_name, fused)

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter name (and q|k|v shard) for a checkpoint tensor name; None to skip it."""
        for prefix in ("bert.", "roberta."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        if name.startswith(SKIPPED) or name.endswith(("position_ids", "token_type_ids")):
            return None
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name.startswith("pooler."):  # BERT's classifier reads the pooler; an embedder pools by itself
            return (name.replace("pooler.dense", "head_dense"), None) if self.num_labels and not self.roberta else None
        if name.startswith("classifier."):
            if not self.num_labels:
                return None
            rest = name[len("classifier."):]
            if rest.startswith("dense."):  # RoBERTa's head
                return "head_dense." + rest[len("dense."):], None
            return "head_out." + rest.removeprefix("out_proj."), None
        m = LAYER_NAME.match(name)
        if m:
            layer, piece, kind = m.groups()
            if piece not in LAYER_NAMES:
                return name, None  # the filler names it as unexpected
            ours, shard = LAYER_NAMES[piece]
            kind = {"gamma": "weight", "beta": "bias"}.get(kind, kind)
            return f"layers.{layer}.{ours}.{kind}", shard
        return name, None


class BertForSequenceClassification(BertModel):
    classifier = True


class RobertaModel(BertModel):
    roberta = True


class RobertaForSequenceClassification(RobertaModel):
    classifier = True
