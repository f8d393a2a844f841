"""The torch backend: the CPU path, and the reference every other backend is tested against.

Decode requests attend in one call: on the CPU, aserve's fused kernel reads each request's blocks in place
(ops.cpu_kernels); elsewhere, or without the kernels, a head-major gather of their blocks and two batched
matmuls. With the kernel, the leading prefill chunks of up to prefill_kernel_max_len() attended tokens (cached
context + chunk) join the decode rows in the same call: each of a chunk's queries is read as a decode query over
its own causal prefix of the cache (the chunk's keys are written before attention runs). Other chunks attend
through SDPA (causal, after any cached context). Masks for sliding-window layers are built once per step and
window size, and shared by the layers that use them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from functools import partial

from aserve.attention import kv_quant
from aserve.attention.backend import BatchLayout
from aserve.ops import cpu_kernels
from aserve.ops.attention import decode_attention, gather, gather_index, prefill_attention


@functools.cache  # asked by every layer of every step; the CPU does not change
def prefill_kernel_max_len() -> int:
    """Attended tokens up to which the kernel takes a prefill chunk: where it beats SDPA, whose blocked matmuls
    win on long chunks. One layer of the bench model's shapes (9 query heads, 3 KV heads, 64 dims) on 2 AMD EPYC
    cores, kernel against SDPA: bf16 (AVX512-BF16) 16 x 128 tokens 3.4 / 9.4 ms, 2 x 1024 19.4 / 27.0, 1 x 2048
    54.9 / 48.9; fp32 (AVX-512) 4 x 512 14.9 / 23.1, 2 x 1024 30.0 / 30.0; fp32 with torch, oneDNN and MKL held to
    AVX2 (ATEN_CPU_CAPABILITY=avx2 etc.) 8 x 256 10.1 / 11.2, 4 x 512 19.3 / 20.5, 2 x 1024 38.7 / 29.6."""
    return 1024 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 512


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flat batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    table: torch.Tensor  # [1, blocks] the blocks that hold its context and itself
    rows: torch.Tensor | None = None  # gather_index of its block table, only when context_len > 0

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
    _kernel_batch: tuple | None = None

    def kernel_batch(self, max_len: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """The rows the kernel takes in one call, as decode queries: (rows, prefill chunks among them, a block
        table per row, each row's attended length). The decode rows, then the leading prefill chunks of at most
        max_len attended tokens, each query over its causal prefix. Built once per step (every layer asks the
        same)."""
        if self._kernel_batch is None:
            tables, lens = ([self.decode_tables], [self.decode_context]) if self.num_decode_tokens else ([], [])
            rows, taken = self.num_decode_tokens, 0
            for chunk in self.prefills:
                n = chunk.end - chunk.start
                if chunk.context_len + n > max_len:
                    break
                tables.append(chunk.table.expand(n, -1))
                lens.append(chunk.context_len + torch.arange(1, n + 1))
                rows, taken = chunk.end, taken + 1
            if not rows:
                self._kernel_batch = (0, 0, None, None)
            else:
                width = max(t.shape[1] for t in tables)
                table = torch.cat([F.pad(t, (0, width - t.shape[1]), value=self.null_block) for t in tables])
                self._kernel_batch = (rows, taken, table, torch.cat(lens))
        return self._kernel_batch

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
        nd = layout.num_decode
        if nd:
            context = torch.tensor(layout.starts[:nd]) + 1
            num_blocks = -(-(max(layout.starts[:nd]) + 1) // bs)
            meta.num_decode_tokens = nd
            meta.decode_tables = tables[:nd, :num_blocks].contiguous()
            meta.decode_context = context
            meta.decode_width = num_blocks * bs
        row = nd
        for i in range(nd, len(layout.counts)):
            start, n = layout.starts[i], layout.counts[i]
            chunk = PrefillChunk(row, row + n, start, tables[i:i + 1, :(start + n + bs - 1) // bs])
            if start:
                chunk.rows = gather_index(chunk.table[0], num_kv_heads, layout.num_physical_blocks)
            meta.prefills.append(chunk)
            row += n
        return meta

    def forward(self, layer, query, key, value, kv_cache, meta: TorchAttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        fmt = self.kv_format
        kv_quant.write(layer, kv_cache, key, value, meta.slot_mapping, fmt)
        window, cap = layer.sliding_window, layer.logit_softcap
        # An FP8 cache is read back through these (the torch path); the C++ kernel dequantizes as it reads.
        widen = None if fmt is None else (partial(kv_quant.dequantize, scale=layer.k_scale, fmt=fmt, dtype=query.dtype),
                                          partial(kv_quant.dequantize, scale=layer.v_scale, fmt=fmt, dtype=query.dtype))
        if fmt is not None and meta.prefills:  # fresh prefill keys, as the cache holds them
            key, value = kv_quant.as_stored(key, layer.k_scale, fmt), kv_quant.as_stored(value, layer.v_scale, fmt)
        out = torch.empty_like(query)
        nd, done = meta.num_decode_tokens, 0  # prefill chunks the kernel took
        if cpu_kernels.usable(query) and (fmt is not None or k_cache.dtype == query.dtype):
            rows, done, tables, lens = meta.kernel_batch(prefill_kernel_max_len())
            if rows:
                torch.ops.aserve.paged_decode_attention(out[:rows], query[:rows], k_cache, v_cache, tables, lens,
                                                        layer.scale, window or 0, cap or 0.0, layer.k_scale,
                                                        layer.v_scale, 0 if fmt is None else fmt.code)
        elif nd:
            out[:nd] = decode_attention(query[:nd], k_cache, v_cache, meta.decode_rows, meta.decode_mask(window),
                                        layer.scale, cap, widen)
        for i, chunk in enumerate(meta.prefills[done:], start=done):
            q = query[chunk.start:chunk.end].transpose(0, 1)  # [Hq, n, D]
            if chunk.context_len == 0:
                k = key[chunk.start:chunk.end].transpose(0, 1)
                v = value[chunk.start:chunk.end].transpose(0, 1)
            else:
                total = chunk.context_len + chunk.end - chunk.start
                k = gather(k_cache, chunk.rows)[:, :total]
                v = gather(v_cache, chunk.rows)[:, :total]
                if widen is not None:
                    k, v = widen[0](k), widen[1](v)
            out[chunk.start:chunk.end] = prefill_attention(q, k, v, meta.prefill_mask(i, window), layer.scale,
                                                           cap).transpose(0, 1)
        return out
