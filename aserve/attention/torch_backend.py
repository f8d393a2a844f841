"""The torch backend: the CPU path, and the reference every other backend is tested against.

On the CPU, two of aserve's kernels (ops.cpu_kernels) read the paged cache in place: decode requests attend in
one call of the decode kernel (with the tokens of short chunks after a cached context, as rows of their own: see
backend.SHORT_CHUNK), and every other prefill chunk in one call of the prefill kernel (FlashAttention's
blocking: each chunk's queries over its cached context, then causally over itself, whose keys are written
before attention runs). Elsewhere, or without the kernels, decode requests go through a head-major gather of
their blocks and two batched matmuls, and each prefill chunk through SDPA (causal, after any cached context).
Masks for sliding-window layers are built once per step and window size, and shared by the layers that use them.
An encoder's bidirectional layer (Attention.causal False) runs every whole prompt of the step in one call of the
varlen kernel (the prefill kernel's tiles over the step's own keys and values, no mask), or else each through SDPA
without a mask, and leaves the cache alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from aserve.attention import kv_quant
from aserve.attention.backend import BatchLayout
from aserve.ops import cpu_kernels
from aserve.ops.attention import decode_attention, gather, gather_index, prefill_attention


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flat batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    table: torch.Tensor  # [1, blocks] the blocks that hold its context and itself
    rows: torch.Tensor | None = None  # gather_index of its block table (torch path, context_len > 0), made once

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[n, context_len + n] bool, True = attend; None for a plain causal chunk with no context."""
        n = self.end - self.start
        if self.context_len == 0 and window is None:
            return None
        query_pos = (self.context_len + torch.arange(n)).unsqueeze(1)
        key_pos = torch.arange(self.context_len + n).unsqueeze(0)
        mask = key_pos <= query_pos
        return mask if window is None else mask & (key_pos > query_pos - window)


@dataclass
class TorchAttentionMetadata:
    backend: "TorchAttentionBackend"
    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_tables: torch.Tensor | None = None  # [num_decode, blocks] the decode requests' block tables
    decode_context: torch.Tensor | None = None  # [num_decode] context length including the new token
    decode_width: int = 0  # gathered tokens per decode request
    num_kv_heads: int = 0
    num_physical_blocks: int = 0
    null_block: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)
    _decode_rows: torch.Tensor | None = None
    _prefill_batch: tuple | None = None
    _prompt_starts: torch.Tensor | None = None

    def prefill_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill kernel's view of the step's chunks: (a block table per chunk, padded with the null block;
        each chunk's first row among the prefill rows, then their end; each chunk's cached context). Built once
        per step (every layer asks the same)."""
        if self._prefill_batch is None:
            width = max(c.table.shape[1] for c in self.prefills)
            tables = torch.cat([F.pad(c.table, (0, width - c.table.shape[1]), value=self.null_block)
                                for c in self.prefills])
            first = self.num_decode_tokens
            starts = torch.tensor([c.start - first for c in self.prefills] + [self.prefills[-1].end - first])
            contexts = torch.tensor([c.context_len for c in self.prefills])
            self._prefill_batch = (tables, starts, contexts)
        return self._prefill_batch

    def prompt_starts(self) -> torch.Tensor:
        """An encoder step's prompts as the varlen kernel takes them: each one's first row, then the end (one-token
        prompts are the decode rows, one each). Built once per step."""
        if self._prompt_starts is None:
            ends = [c.end for c in self.prefills]
            self._prompt_starts = torch.tensor(list(range(self.num_decode_tokens + 1)) + ends)
        return self._prompt_starts

    @property
    def decode_rows(self) -> torch.Tensor:
        """gather_index of the decode block tables, for the unfused path; built once per step."""
        if self._decode_rows is None:
            self._decode_rows = gather_index(self.decode_tables, self.num_kv_heads, self.num_physical_blocks)
        return self._decode_rows

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[1, num_decode, 1, width] bool; with a window only the last `window` positions are attended."""
        key = ("decode", window)
        if key not in self._masks:
            pos = torch.arange(self.decode_width).unsqueeze(0)
            context = self.decode_context.unsqueeze(1)
            mask = pos < context
            if window is not None:
                mask &= pos >= context - window
            self._masks[key] = mask[None, :, None, :]
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        key = (i, window)
        if key not in self._masks:
            self._masks[key] = self.prefills[i].mask(window)
        return self._masks[key]


class TorchAttentionBackend:
    name = "torch"
    block_dim = 3  # [layers, 2, kv_heads, blocks, block_size, head_dim]
    kv_format: kv_quant.FP8Format | None = None  # an FP8 cache (set by the runner), else the model's dtype

    def kv_cache_shape(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def build_metadata(self, layout: BatchLayout, num_kv_heads: int) -> TorchAttentionMetadata:
        bs, tables = layout.block_size, layout.block_tables
        meta = TorchAttentionMetadata(self, layout.slot_mapping, num_kv_heads=num_kv_heads,
                                      num_physical_blocks=layout.num_physical_blocks,
                                      null_block=layout.num_physical_blocks - 1)
        nd, starts, counts = layout.num_decode, layout.starts, layout.counts
        rows, context = list(range(nd)), [start + 1 for start in starts[:nd]]
        chunk = nd
        while chunk < nd + layout.num_short:  # short chunks past their prompts, as decode rows (SHORT_CHUNK)
            rows += [chunk] * counts[chunk]
            context += range(starts[chunk] + 1, starts[chunk] + counts[chunk] + 1)
            chunk += 1
        if rows:
            num_blocks = -(-max(context) // bs)
            meta.num_decode_tokens = len(rows)
            meta.decode_tables = (tables[:nd, :num_blocks].contiguous() if chunk == nd
                                  else tables[torch.tensor(rows), :num_blocks])
            meta.decode_context = torch.tensor(context)
            meta.decode_width = num_blocks * bs
        row = len(rows)
        for i in range(chunk, len(counts)):
            start, n = layout.starts[i], layout.counts[i]
            meta.prefills.append(PrefillChunk(row, row + n, start, tables[i:i + 1, :(start + n + bs - 1) // bs]))
            row += n
        return meta

    def forward(self, layer, query, key, value, kv_cache, meta: TorchAttentionMetadata) -> torch.Tensor:
        if not layer.causal:
            return bidirectional(layer, query, key, value, meta)
        k_cache, v_cache = kv_cache
        fmt = self.kv_format
        kv_quant.write(layer, kv_cache, key, value, meta.slot_mapping, fmt, paired_keys=True)
        window, cap = layer.sliding_window, layer.logit_softcap
        # An FP8 cache is read back through these (the torch path); the C++ kernel dequantizes as it reads.
        widen = None if fmt is None else (partial(kv_quant.dequantize, scale=layer.k_scale, fmt=fmt, dtype=query.dtype),
                                          partial(kv_quant.dequantize, scale=layer.v_scale, fmt=fmt, dtype=query.dtype))
        out = torch.empty_like(query)
        nd = meta.num_decode_tokens
        if cpu_kernels.usable(query) and (fmt is not None or k_cache.dtype == query.dtype):
            code = 0 if fmt is None else fmt.code
            if nd:
                torch.ops.aserve.paged_decode_attention(out[:nd], query[:nd], k_cache, v_cache, meta.decode_tables,
                                                        meta.decode_context, layer.scale, window or 0, cap or 0.0,
                                                        layer.k_scale, layer.v_scale, code)
            if meta.prefills:
                torch.ops.aserve.paged_prefill_attention(out[nd:], query[nd:], k_cache, v_cache, *meta.prefill_batch(),
                                                         layer.scale, window or 0, cap or 0.0, layer.k_scale,
                                                         layer.v_scale, code)
            return out
        if nd:
            out[:nd] = decode_attention(query[:nd], k_cache, v_cache, meta.decode_rows, meta.decode_mask(window),
                                        layer.scale, cap, widen)
        if fmt is not None and meta.prefills:  # fresh prefill keys, as the cache holds them
            key, value = kv_quant.as_stored(key, layer.k_scale, fmt), kv_quant.as_stored(value, layer.v_scale, fmt)
        for i, chunk in enumerate(meta.prefills):
            q = query[chunk.start:chunk.end].transpose(0, 1)  # [Hq, n, D]
            if chunk.context_len == 0:
                k = key[chunk.start:chunk.end].transpose(0, 1)
                v = value[chunk.start:chunk.end].transpose(0, 1)
            else:
                total = chunk.context_len + chunk.end - chunk.start
                if chunk.rows is None:  # the first layer to need it; the others reuse it
                    chunk.rows = gather_index(chunk.table[0], meta.num_kv_heads, meta.num_physical_blocks)
                k = gather(k_cache, chunk.rows, paired_keys=True)[:, :total]
                v = gather(v_cache, chunk.rows)[:, :total]
                if widen is not None:
                    k, v = widen[0](k), widen[1](v)
            out[chunk.start:chunk.end] = prefill_attention(q, k, v, meta.prefill_mask(i, window), layer.scale,
                                                           cap).transpose(0, 1)
        return out


def bidirectional(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  meta: TorchAttentionMetadata) -> torch.Tensor:
    """An encoder layer: each prompt, whole in this step (the scheduler never chunks one), attends over all of
    itself. Nothing is written to the cache or read from it: no later step needs these keys."""
    if (meta.prefills and max(c.context_len for c in meta.prefills)) or (
            meta.num_decode_tokens and int(meta.decode_context.max()) > 1):
        raise RuntimeError("a bidirectional layer was given part of a prompt: encoder prompts must be scheduled whole")
    out = torch.empty_like(query)
    if cpu_kernels.usable(query):
        torch.ops.aserve.varlen_attention(out, query, key, value, meta.prompt_starts(), layer.scale, False)
        return out
    nd, gqa = meta.num_decode_tokens, query.shape[1] != key.shape[1]
    if nd:  # one-token prompts: each token sees itself alone
        out[:nd] = value[:nd].repeat_interleave(query.shape[1] // key.shape[1], 1)
    for chunk in meta.prefills:
        q, k, v = (t[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out[chunk.start:chunk.end] = F.scaled_dot_product_attention(q, k, v, scale=layer.scale,
                                                                    enable_gqa=gqa)[0].transpose(0, 1)
    return out
