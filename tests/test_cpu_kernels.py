"""aserve's fused CPU kernels (ops.cpu_kernels) against the torch path they replace.

Decode attention over the paged cache at block sizes 1/16/32, with GQA and without, mixed context lengths
(one token, inside a block, on and past block edges), sliding windows and soft-capping; prefill attention over
the same cache (chunks with and without cached context, causal within the chunk), checked against the same
reference (each of a chunk's queries is a decode query over its own causal prefix); the same kernel over the step's
own rows (varlen attention: an encoder's bidirectional layers) against SDPA; RMSNorm, rotary embedding
(full and partial), SiLU-and-mul and an encoder's add-then-LayerNorm. fp32 must agree to rounding; bf16/fp16 within their precision.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from aserve.attention.kv_quant import FP8_FORMATS, dequantize, quantize
from aserve.models.layers import RMSNorm, RotaryEmbedding, add_layer_norm, silu_and_mul
from aserve.ops import cpu_kernels
from aserve.ops.attention import decode_attention, gather_index, pair_keys, unpair_keys, write_kv
from conftest import scattered_tables

# Skipped only where no C++ compiler exists; with one, a kernel that fails to build fails these tests.
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")


@pytest.fixture(autouse=True)
def kernels_loaded():
    """Every test here builds (or loads) the kernels itself, so none depends on running after another."""
    assert cpu_kernels.available()

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def paged_case(lengths, block_size, heads, head_dim, dtype, gen):
    """A cache over a random permutation of blocks, tables padded with the null (last) block."""
    num_heads, num_kv_heads = heads
    need = [-(-n // block_size) for n in lengths]
    null = sum(need) + 3  # a few blocks nobody owns: the kernel must not read them
    tables = scattered_tables(need, null, gen)
    shape = (num_kv_heads, null + 1, block_size, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, torch.tensor(lengths), null + 1


def reference(query, k_cache, v_cache, tables, lengths, num_physical, block_size, scale, window, softcap):
    """The torch path (gather + two matmuls) in fp32 on the same rounded inputs."""
    num_kv_heads = k_cache.shape[0]
    width = tables.shape[1] * block_size
    pos = torch.arange(width).unsqueeze(0)
    mask = pos < lengths.unsqueeze(1)
    if window is not None:
        mask &= pos >= lengths.unsqueeze(1) - window
    rows = gather_index(tables, num_kv_heads, num_physical)
    return decode_attention(query.float(), k_cache.float(), v_cache.float(), rows, mask[None, :, None, :], scale,
                            softcap)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the unrolled sizes and the runtime-sized path
def test_decode_attention_matches_torch_path(block_size, heads, dtype, head_dim):
    gen = torch.Generator().manual_seed(block_size * 100 + heads[0])
    lengths = [1, 7, block_size, block_size + 1, 3 * block_size - 1, 70, 128, 129, 300]  # 128 and up: in parts
    query, k_cache, v_cache, tables, lens, num_physical = paged_case(lengths, block_size, heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5
    out = torch.empty_like(query)
    with torch.inference_mode():
        torch.ops.aserve.paged_decode_attention(out, query, k_cache, v_cache, tables, lens, scale, 0, 0.0)
    expected = reference(query, k_cache, v_cache, tables, lens, num_physical, block_size, scale, None, None)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("batch", [1, 2, 40])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0), (17, 50.0), (200, None),
                                            (150, 20.0)])
def test_decode_attention_windows_softcap_and_batch_sizes(batch, window, softcap):
    """Contexts up to 400 tokens: those over 128 are attended in parts whose softmaxes are merged; windows of
    more than a part keep several."""
    gen = torch.Generator().manual_seed(batch)
    lengths = [int(x) for x in torch.randint(1, 400, (batch,), generator=gen)]
    query, k_cache, v_cache, tables, lens, num_physical = paged_case(lengths, 16, (8, 2), 32, torch.float32, gen)
    out = torch.empty_like(query)
    with torch.inference_mode():
        torch.ops.aserve.paged_decode_attention(out, query, k_cache, v_cache, tables, lens, 0.2, window or 0,
                                                softcap or 0.0)
    expected = reference(query, k_cache, v_cache, tables, lens, num_physical, 16, 0.2, window, softcap)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_gives_a_request_the_same_bits_in_any_batch(dtype):
    """How a request's context is cut into parts depends on its length alone: alone, or among others (long
    and short, more threads' worth), its output is the same to the bit."""
    gen = torch.Generator().manual_seed(3)
    lengths = [300, 5, 129, 700, 64]
    query, k_cache, v_cache, tables, lens, _ = paged_case(lengths, 16, (9, 3), 64, dtype, gen)
    batched = torch.empty_like(query)
    with torch.inference_mode():
        torch.ops.aserve.paged_decode_attention(batched, query, k_cache, v_cache, tables, lens, 0.125, 0, 0.0)
        for i in range(len(lengths)):
            alone = torch.empty_like(query[i:i + 1])
            torch.ops.aserve.paged_decode_attention(alone, query[i:i + 1], k_cache, v_cache, tables[i:i + 1],
                                                    lens[i:i + 1], 0.125, 0, 0.0)
            assert torch.equal(alone, batched[i:i + 1]), lengths[i]


@pytest.mark.parametrize("products", ["dpbf16", "fma"])
@pytest.mark.parametrize("head_dim,heads", [(64, (9, 3)), (128, (4, 2)), (256, (2, 1))])
def test_decode_attention_over_a_bf16_cache_on_either_product(bf16_products, products, head_dim, heads):
    """A bf16 cache's products run on vdpbf16ps or on fp32 FMAs (rows split into even and odd dims), whichever
    bf16_products chose: both match the torch path, windows and soft-capping included, from a strided query, and
    give a request the same bits in any batch."""
    bf16_products(products)
    gen = torch.Generator().manual_seed(head_dim)
    lengths = [1, 2, 15, 16, 17, 33, 127, 128, 129, 300]
    query, k_cache, v_cache, tables, lens, num_physical = paged_case(lengths, 16, heads, head_dim, torch.bfloat16, gen)
    wide = torch.zeros(len(lengths), heads[0], head_dim + 32, dtype=torch.bfloat16)
    wide[:, :, :head_dim] = query
    strided = wide[:, :, :head_dim]
    scale = head_dim ** -0.5
    for window, softcap in [(None, None), (20, None), (None, 30.0), (150, 20.0)]:
        out = torch.empty_like(query)
        with torch.inference_mode():
            torch.ops.aserve.paged_decode_attention(out, strided, k_cache, v_cache, tables, lens, scale, window or 0,
                                                    softcap or 0.0)
        expected = reference(query, k_cache, v_cache, tables, lens, num_physical, 16, scale, window, softcap)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for i in (0, 5, 8, 9):
        alone = torch.empty_like(query[i:i + 1])
        with torch.inference_mode():
            torch.ops.aserve.paged_decode_attention(alone, query[i:i + 1], k_cache, v_cache, tables[i:i + 1],
                                                    lens[i:i + 1], scale, 150, 20.0)
        assert torch.equal(alone, out[i:i + 1]), lengths[i]


@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])  # the unrolled sizes' vector widening and the scalar one
@pytest.mark.parametrize("products", [None, "fma"])  # the CPU's choice; bf16 products on FMAs (widened to fp32)
def test_decode_attention_reads_an_fp8_cache(fmt, dtype, head_dim, products):
    """FP8 bytes with per-tensor scales, dequantized in the kernel: the torch path on the dequantized cache. A bf16
    query meets them on vdpbf16ps where the CPU has AVX512-BF16 and VBMI, widened to fp32 with FMA products."""
    packs = torch.ops.aserve.gemm_packs_bf16()
    if products is not None and not (packs and dtype == torch.bfloat16):
        pytest.skip("bf16 products are chosen only for bf16 queries on a CPU with AVX512-BF16")
    gen = torch.Generator().manual_seed(head_dim)
    f = FP8_FORMATS[fmt]
    lengths = [1, 16, 17, 70, 31, 260]
    query, k_cache, v_cache, tables, lens, num_physical = paged_case(lengths, 16, (6, 2), head_dim, torch.float32, gen)
    k_scale, v_scale = 0.01, 0.02  # values up to ~4 land at 400 / 200: e4m3's top range and subnormals both occur
    k_bits, v_bits = quantize(k_cache, k_scale, f), quantize(v_cache * 1.5, v_scale, f)
    query = query.to(dtype)
    out = torch.empty_like(query)
    before = torch.ops.aserve.gemm_bf16_products() if packs else None
    try:
        if products is not None:
            torch.ops.aserve.gemm_bf16_products(products)
        with torch.inference_mode():
            torch.ops.aserve.paged_decode_attention(out, query, k_bits, v_bits, tables, lens, head_dim ** -0.5, 0,
                                                    0.0, k_scale, v_scale, f.code)
    finally:
        if packs:
            torch.ops.aserve.gemm_bf16_products(before)
    k_ref, v_ref = (dequantize(b, sc, f, torch.float32) for b, sc in ((k_bits, k_scale), (v_bits, v_scale)))
    expected = reference(query, k_ref, v_ref, tables, lens, num_physical, 16, head_dim ** -0.5, None, None)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
@pytest.mark.parametrize("head_dim", [64, 40])
def test_decode_attention_widens_every_fp8_pattern_exactly(fmt, head_dim):
    """Every finite FP8 pattern as keys and values: attention over the bytes gives the bits it gives over their
    values in an fp32 cache. With scales of 2^-8 the kernel's e4m3 2^8 folds in exactly, so any difference is
    the widening's."""
    gen = torch.Generator().manual_seed(11)
    f = FP8_FORMATS[fmt]
    lengths = [300, 17, 16, 1]  # whole blocks of 16, parts of 128 merged, a partial block
    query, k_cache, _, tables, lens, _ = paged_case(lengths, 16, (6, 2), head_dim, torch.float32, gen)
    finite = torch.arange(256, dtype=torch.uint8)
    finite = finite[finite.view(f.dtype).float().isfinite()]
    k_bits, v_bits = (finite[torch.randint(len(finite), k_cache.shape, generator=gen)] for _ in range(2))
    scale = 2.0 ** -8
    fp8_out, fp32_out = torch.empty_like(query), torch.empty_like(query)
    with torch.inference_mode():
        torch.ops.aserve.paged_decode_attention(fp8_out, query, k_bits, v_bits, tables, lens, 0.125, 0, 0.0, scale,
                                                scale, f.code)
        torch.ops.aserve.paged_decode_attention(fp32_out, query, dequantize(k_bits, scale, f, torch.float32),
                                                dequantize(v_bits, scale, f, torch.float32), tables, lens, 0.125, 0,
                                                0.0)
    assert torch.equal(fp8_out, fp32_out)


@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
@pytest.mark.parametrize("head_dim,heads,block_size", [(64, (9, 3), 16), (128, (4, 2), 1), (256, (2, 1), 32)])
def test_decode_attention_reads_fp8_as_a_bf16_cache_of_its_values(fmt, head_dim, heads, block_size):
    """A bf16 query over FP8 bytes gives the bits it gives over a bf16 cache of their values, windows and
    soft-capping included: with AVX512-BF16 and VBMI the bytes become those values' bf16 patterns (times a power of
    two the sums drop again) for vdpbf16ps, elsewhere both caches are widened to fp32. Every finite pattern occurs;
    outputs below 1e-20 may differ, where the bf16 cache's products fall to fp32's denormals and vdpbf16ps flushes
    them, while the FP8 path's lifted ones stay normal."""
    packs = torch.ops.aserve.gemm_packs_bf16()
    if packs and "avx512vbmi" not in cpu_kernels._cpu_flags().split():
        pytest.skip("an FP8 cache meets vdpbf16ps only with AVX512-VBMI; a bf16 cache does without it")
    before = torch.ops.aserve.gemm_bf16_products()
    gen = torch.Generator().manual_seed(head_dim)
    f = FP8_FORMATS[fmt]
    lengths = [300, 17, 16, 1, 2, 15, 33, 129]
    query, k_cache, _, tables, lens, _ = paged_case(lengths, block_size, heads, head_dim, torch.bfloat16, gen)
    finite = torch.arange(256, dtype=torch.uint8)
    finite = finite[finite.view(f.dtype).float().isfinite()]
    k_bits, v_bits = (finite[torch.randint(len(finite), k_cache.shape, generator=gen)] for _ in range(2))
    k_scale, v_scale = 2.0 ** -9, 2.0 ** -6
    k_values, v_values = dequantize(k_bits, k_scale, f, torch.bfloat16), dequantize(v_bits, v_scale, f, torch.bfloat16)
    try:
        if packs:
            torch.ops.aserve.gemm_bf16_products("dpbf16")
        for window, softcap in [(0, 0.0), (20, 0.0), (150, 20.0)]:
            fp8_out, bf16_out = torch.empty_like(query), torch.empty_like(query)
            with torch.inference_mode():
                torch.ops.aserve.paged_decode_attention(fp8_out, query, k_bits, v_bits, tables, lens, 0.125, window,
                                                        softcap, k_scale, v_scale, f.code)
                torch.ops.aserve.paged_decode_attention(bf16_out, query, k_values, v_values, tables, lens, 0.125,
                                                        window, softcap)
            torch.testing.assert_close(fp8_out, bf16_out, rtol=0, atol=1e-20)
    finally:
        torch.ops.aserve.gemm_bf16_products(before)


def prefill_case(chunks, block_size, heads, head_dim, dtype, gen):
    """Chunks (cached context, new tokens) over a scattered cache holding every chunk's context and tokens, with
    each query row's expansion as a decode query: its chunk's table and its own causal length."""
    query, k_cache, v_cache, tables, _, num_physical = paged_case([c + n for c, n in chunks], block_size, heads,
                                                                   head_dim, dtype, gen)
    rows = sum(n for _, n in chunks)
    query = torch.randn(rows, heads[0], head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
    contexts = torch.tensor([c for c, _ in chunks])
    row_tables = torch.cat([tables[i:i + 1].expand(n, -1) for i, (_, n) in enumerate(chunks)])
    row_lens = torch.cat([torch.arange(c + 1, c + n + 1) for c, n in chunks])
    return query, k_cache, v_cache, tables, starts, contexts, row_tables, row_lens, num_physical


def run_prefill(query, k_cache, v_cache, tables, starts, contexts, scale, window=0, softcap=0.0, *scales):
    out = torch.full_like(query, float("nan"))  # every row must be written
    with torch.inference_mode():
        torch.ops.aserve.paged_prefill_attention(out, query, k_cache, v_cache, tables, starts, contexts, scale,
                                                 window, softcap, *scales)
    return out


# (150, 250): several key steps of every kind, AMX's longer steps too
CHUNKS = [(0, 1), (0, 7), (0, 70), (5, 20), (16, 16), (33, 64), (3, 1), (0, 130), (150, 250)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the register tiles' widths and a tail of head dims
def test_prefill_attention_matches_torch_path(block_size, heads, dtype, head_dim):
    gen = torch.Generator().manual_seed(block_size * 100 + heads[0] + head_dim)
    query, k_cache, v_cache, tables, starts, contexts, row_tables, row_lens, num_physical = prefill_case(
        CHUNKS, block_size, heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5
    out = run_prefill(query, k_cache, v_cache, tables, starts, contexts, scale)
    expected = reference(query, k_cache, v_cache, row_tables, row_lens, num_physical, block_size, scale, None, None)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the pairs path where the CPU takes it
@pytest.mark.parametrize("window,softcap", [(5, None), (None, 30.0), (17, 50.0), (40, None)])
def test_prefill_attention_windows_and_softcap(window, softcap, dtype):
    """Windows shorter than a chunk (rows whose first keys lie in a later step of the walk) and soft-capping."""
    gen = torch.Generator().manual_seed(window or 1)
    query, k_cache, v_cache, tables, starts, contexts, row_tables, row_lens, num_physical = prefill_case(
        CHUNKS, 16, (8, 2), 32, dtype, gen)
    out = run_prefill(query, k_cache, v_cache, tables, starts, contexts, 0.2, window or 0, softcap or 0.0)
    expected = reference(query, k_cache, v_cache, row_tables, row_lens, num_physical, 16, 0.2, window, softcap)
    tol = 2e-5 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("products", ["dpbf16", "fma"])
def test_prefill_attention_over_a_bf16_cache_on_either_product(bf16_products, products):
    """bf16 queries over a bf16 cache run on vdpbf16ps pairs, or on the fp32 tiles (rows widened) where bf16 products
    run on FMAs: both match the torch path, with windows and soft-capping, and an FP8 cache follows the same choice
    (the same bits as a bf16 cache holding its values)."""
    bf16_products(products)
    gen = torch.Generator().manual_seed(11)
    query, k_cache, v_cache, tables, starts, contexts, row_tables, row_lens, num_physical = prefill_case(
        CHUNKS, 16, (9, 3), 64, torch.bfloat16, gen)
    for window, softcap in [(None, None), (40, None), (None, 30.0)]:
        out = run_prefill(query, k_cache, v_cache, tables, starts, contexts, 0.125, window or 0, softcap or 0.0)
        expected = reference(query, k_cache, v_cache, row_tables, row_lens, num_physical, 16, 0.125, window, softcap)
        torch.testing.assert_close(out.float(), expected, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    f = FP8_FORMATS["fp8_e4m3"]
    k_bits, v_bits = quantize(k_cache.float(), 1.0, f), quantize(v_cache.float(), 1.0, f)
    k_bf16, v_bf16 = (dequantize(b, 1.0, f, torch.bfloat16) for b in (k_bits, v_bits))
    assert torch.equal(run_prefill(query, k_bits, v_bits, tables, starts, contexts, 0.125, 0, 0.0, 1.0, 1.0, f.code),
                       run_prefill(query, k_bf16, v_bf16, tables, starts, contexts, 0.125, 0, 0.0, 1.0, 1.0, 0))


@pytest.mark.parametrize("products", [None, "fma"])  # bf16: vdpbf16ps pairs where the CPU takes them, fp32 tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
def test_prefill_gives_a_chunks_rows_the_same_bits_however_it_is_split(request, products, dtype, block_size, heads):
    """A prompt's rows must not depend on how it reached the kernel (whole, or its tail after a prefix-cache hit or a
    chunked prefill): the tail's few rows take the narrow tiles (keys across the vector) where a whole chunk's take
    full ones, and each score must come out the same. Tails of 1-6 tokens over 200 cached ones, with windows and
    soft-capping."""
    if products is not None:
        if dtype != torch.bfloat16:
            pytest.skip("the product choice is bf16's")
        request.getfixturevalue("bf16_products")(products)
    gen = torch.Generator().manual_seed(block_size * 10 + heads[0])
    context, n = 200, 40
    query, k_cache, v_cache, tables, _, _, _, _, _ = prefill_case([(context, n)], block_size, heads, 64, dtype, gen)
    for window, softcap in [(0, 0.0), (37, 0.0), (0, 30.0)]:
        whole = run_prefill(query, k_cache, v_cache, tables, torch.tensor([0, n]), torch.tensor([context]), 0.125,
                            window, softcap)
        for tail in (1, 2, 3, 5, 6):
            split = run_prefill(query, k_cache, v_cache, tables.expand(2, -1).contiguous(), torch.tensor([0, n - tail, n]),
                                torch.tensor([context, context + n - tail]), 0.125, window, softcap)
            assert torch.equal(split, whole), (window, softcap, tail)


@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_an_fp8_cache(fmt, dtype):
    gen = torch.Generator().manual_seed(3)
    f = FP8_FORMATS[fmt]
    query, k_cache, v_cache, tables, starts, contexts, row_tables, row_lens, num_physical = prefill_case(
        CHUNKS, 16, (6, 2), 64, torch.float32, gen)
    k_scale, v_scale = 0.01, 0.02
    k_bits, v_bits = quantize(k_cache, k_scale, f), quantize(v_cache * 1.5, v_scale, f)
    query = query.to(dtype)
    out = run_prefill(query, k_bits, v_bits, tables, starts, contexts, 0.125, 0, 0.0, k_scale, v_scale, f.code)
    k_ref, v_ref = (dequantize(b, sc, f, torch.float32) for b, sc in ((k_bits, k_scale), (v_bits, v_scale)))
    expected = reference(query, k_ref, v_ref, row_tables, row_lens, num_physical, 16, 0.125, None, None)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_prefill_over_fp8_equals_prefill_over_the_same_values_in_bf16(fmt, head_dim):
    """Every FP8 value is a bf16 value, so bf16 queries over an FP8 cache (unit scales) give the bits that a bf16
    cache holding the dequantized values gives: with AVX512-BF16 both run the bf16 tiles (the FP8 rows made bf16 a
    key step at a time), elsewhere (and where bf16 products run on FMAs) both widen to fp32. Subnormal and extreme
    FP8 values included; head_dim 40 takes the fp32 tiles."""
    gen = torch.Generator().manual_seed(head_dim)
    f = FP8_FORMATS[fmt]
    query, k_cache, v_cache, tables, starts, contexts, *_ = prefill_case(CHUNKS, 16, (6, 2), head_dim,
                                                                         torch.float32, gen)
    k_bits, v_bits = quantize(k_cache * 40, 1.0, f), quantize(v_cache * 1e-3, 1.0, f)  # wide and subnormal values
    k_bf16, v_bf16 = (dequantize(b, 1.0, f, torch.bfloat16) for b in (k_bits, v_bits))
    assert torch.equal(k_bf16.float(), dequantize(k_bits, 1.0, f, torch.float32))  # exact in bf16
    query = query.bfloat16()
    got = run_prefill(query, k_bits, v_bits, tables, starts, contexts, 0.125, 0, 0.0, 1.0, 1.0, f.code)
    want = run_prefill(query, k_bf16, v_bf16, tables, starts, contexts, 0.125, 0, 0.0, 1.0, 1.0, 0)
    assert torch.equal(got, want)


def test_prefill_attention_refuses_tables_shorter_than_the_chunk_or_outside_the_cache():
    gen = torch.Generator().manual_seed(0)
    query, k_cache, v_cache, tables, starts, contexts, *_ = prefill_case([(4, 40)], 16, (2, 2), 32,
                                                                         torch.float32, gen)
    with pytest.raises(RuntimeError, match="block table is shorter"):
        run_prefill(query, k_cache, v_cache, tables[:, :2], starts, contexts, 0.1)
    for stray in (k_cache.shape[1], -1):
        bad = tables.clone()
        bad[0, 1] = stray
        with pytest.raises(RuntimeError, match="outside the cache"):
            run_prefill(query, k_cache, v_cache, bad, starts, contexts, 0.1)


@pytest.mark.parametrize("heads", [(6, 2), (12, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attention_matches_sdpa(heads, dtype, head_dim, causal):
    """The step's own rows, no cache: each prompt over all of itself (an encoder's layers) or causally. Strided
    keys and values (slices of a fused QKV product), prompts of 1 to 400 tokens (odd key counts, a last walk step
    shorter than the others, tiles of one token, several steps of AMX's longer walk)."""
    gen = torch.Generator().manual_seed(head_dim + heads[0] + causal)
    lengths = [1, 7, 33, 130, 2, 64, 400]
    num_heads, num_kv_heads = heads
    rows = sum(lengths)
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    query = q.reshape(rows, num_heads, head_dim)
    key, value = k.view(rows, num_kv_heads, head_dim), v.view(rows, num_kv_heads, head_dim)
    starts = torch.tensor([0] + lengths).cumsum(0)
    out = torch.full_like(query, float("nan"))
    with torch.inference_mode():
        torch.ops.aserve.varlen_attention(out, query, key, value, starts, head_dim ** -0.5, causal)
    expected = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].float().transpose(0, 1) for t in (query, key, value)), is_causal=causal,
            enable_gqa=num_heads != num_kv_heads).transpose(0, 1)
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())])
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_varlen_attention_refuses_bad_starts():
    query = torch.zeros(10, 2, 32)
    with pytest.raises(RuntimeError, match="query_starts must rise"):
        torch.ops.aserve.varlen_attention(torch.empty_like(query), query, query, query, torch.tensor([0, 6, 4, 10]),
                                          0.1, False)
    with pytest.raises(RuntimeError, match="query_starts must rise"):
        torch.ops.aserve.varlen_attention(torch.empty_like(query), query, query, query, torch.tensor([0, 11]),
                                          0.1, False)


def test_fp8_bytes_round_trip_every_pattern():
    """Every finite FP8 pattern survives dequantize -> quantize (so a swapped or copied block reads the same)."""
    for f in FP8_FORMATS.values():
        bits = torch.arange(256, dtype=torch.uint8)
        values = bits.view(f.dtype).float()
        finite = values.isfinite()
        again = quantize(dequantize(bits, 0.5, f, torch.float32), 0.5, f)
        assert torch.equal(again[finite], bits[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [None, *sorted(FP8_FORMATS)])
@pytest.mark.parametrize("paired_keys", [True, False])
def test_write_kv_stores_the_bytes_the_torch_path_stores(dtype, fmt, paired_keys):
    """Strided keys (a slice of the fused QKV output), slots all over the cache, FP8 values that saturate; keys
    as rows or in pairs of dims."""
    gen = torch.Generator().manual_seed(5)
    f = FP8_FORMATS[fmt] if fmt else None
    heads, blocks, block_size, dim, tokens = 3, 20, 16 if paired_keys else 8, 40, 37
    key = (torch.randn(tokens, heads + 2, dim, generator=gen) * 300).to(dtype)[:, 1:heads + 1]
    value = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    # a prompt's run of slots from inside a block across two more (written a block's run at a time), then slots
    # all over the cache (decode tokens)
    run = torch.arange(block_size + 5, block_size + 35)
    slots = torch.cat([run, torch.randperm(blocks * block_size - 64, generator=gen)[:tokens - 30] + 64])
    cache_dtype = torch.uint8 if f else dtype
    ours, theirs = ([torch.zeros(heads, blocks, block_size, dim, dtype=cache_dtype) for _ in range(2)] for _ in range(2))
    with torch.inference_mode():
        torch.ops.aserve.write_kv(key, value, ours[0], ours[1], slots, 0.5, 0.25, f.code if f else 0, paired_keys)
        k, v = (quantize(key, 0.5, f), quantize(value, 0.25, f)) if f else (key, value)
        write_kv(theirs[0], theirs[1], k, v, slots, paired_keys)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    stored = unpair_keys(ours[0]) if paired_keys else ours[0]  # each key's row where its slot is
    assert torch.equal(stored.view(heads, -1, dim)[:, slots].transpose(0, 1), k.contiguous().view(stored.dtype))
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.aserve.write_kv(key, value, ours[0], ours[1], slots + blocks * block_size, 0.5, 0.25,
                                  f.code if f else 0, paired_keys)


def test_paired_keys_are_pairs_of_dims_token_after_token():
    """A block's keys [head_dim / 2][block_size][2]: pair p of token t at p * 2 * block_size + 2 t, as the kernels
    read them; pair_keys and unpair_keys undo each other."""
    rows = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).view(2, 3, 4, 6)  # [heads, blocks, block_size, dim]
    paired = pair_keys(rows)
    flat = paired.view(2, 3, 4 * 6)
    for p in range(3):
        for t in range(4):
            assert torch.equal(flat[:, :, p * 8 + 2 * t:p * 8 + 2 * t + 2], rows[:, :, t, 2 * p:2 * p + 2])
    assert torch.equal(unpair_keys(paired), rows)


@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
def test_write_kv_rounds_every_fp8_case_as_torch_does(fmt):
    """Every FP8 value, the midpoints between neighbours (ties go to even) and the floats either side of them,
    subnormals, +-0, NaN and values past the format's range, through the 16-at-a-time path and the tail: the bytes
    torch's conversion stores."""
    f = FP8_FORMATS[fmt]
    exact = torch.arange(256, dtype=torch.uint8).view(f.dtype).float()
    exact = exact[exact.isfinite()].unique()
    mids = (exact[1:] + exact[:-1]) / 2
    values = torch.cat([exact, mids, mids.nextafter(torch.tensor(float("inf"))),
                        mids.nextafter(torch.tensor(float("-inf"))), -mids,
                        torch.tensor([0.0, -0.0, float("nan"), -float("nan"), 1e30, -1e30, 1e-30, -1e-30,
                                      f.max * 1.01, -f.max * 1.03])])
    dim = 53  # each row: three vectors of 16, then a tail of 5 one at a time
    key = torch.cat([values, torch.zeros(-values.numel() % dim)]).view(-1, 1, dim)
    tokens = key.shape[0]
    slots = torch.arange(tokens)
    ours = [torch.zeros(1, tokens, 1, dim, dtype=torch.uint8) for _ in range(2)]
    with torch.inference_mode():
        torch.ops.aserve.write_kv(key, key, ours[0], ours[1], slots, 1.0, 1.0, f.code)
    assert torch.equal(ours[0].view(tokens, dim), quantize(key, 1.0, f).view(tokens, dim))


def test_decode_attention_reads_strided_query_and_writes_into_a_view():
    """The backend passes a slice of the fused QKV output as the query and a slice of its output buffer."""
    gen = torch.Generator().manual_seed(3)
    query, k_cache, v_cache, tables, lens, num_physical = paged_case([5, 33], 16, (4, 2), 16, torch.float32, gen)
    wide = torch.randn(2, 4 * 16 + 64, generator=gen)
    wide[:, :64] = query.reshape(2, 64)
    strided = wide[:, :64].view(2, 4, 16)
    out = torch.zeros(3, 4, 16)
    with torch.inference_mode():
        torch.ops.aserve.paged_decode_attention(out[:2], strided, k_cache, v_cache, tables, lens, 0.25, 0, 0.0)
    expected = reference(query, k_cache, v_cache, tables, lens, num_physical, 16, 0.25, None, None)
    torch.testing.assert_close(out[:2], expected, atol=2e-5, rtol=2e-5)
    assert out[2].abs().sum() == 0


def test_decode_attention_rejects_bad_input():
    gen = torch.Generator().manual_seed(4)
    query, k_cache, v_cache, tables, lens, _ = paged_case([5], 16, (4, 2), 16, torch.float32, gen)
    with pytest.raises(RuntimeError, match="block_tables"):
        torch.ops.aserve.paged_decode_attention(torch.empty_like(query), query, k_cache, v_cache, tables.int(), lens,
                                                1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.aserve.paged_decode_attention(torch.empty_like(query), query, k_cache.double(),
                                                v_cache.double(), tables, lens, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="uint8"):  # FP8 bytes with kv_format 0, a float cache with 1
        torch.ops.aserve.paged_decode_attention(torch.empty_like(query), query, k_cache.to(torch.uint8),
                                                v_cache.to(torch.uint8), tables, lens, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.aserve.paged_decode_attention(torch.empty_like(query), query, k_cache, v_cache, tables, lens,
                                                1.0, 0, 0.0, 1.0, 1.0, 1)
    with pytest.raises(RuntimeError, match="kv_format"):
        torch.ops.aserve.paged_decode_attention(torch.empty_like(query), query, k_cache.to(torch.uint8),
                                                v_cache.to(torch.uint8), tables, lens, 1.0, 0, 0.0, 1.0, 1.0, 3)
    # a table too short for its context, or pointing outside the cache: an error, not a read past the cache
    with pytest.raises(RuntimeError, match="block table is shorter"):
        torch.ops.aserve.paged_decode_attention(torch.empty_like(query), query, k_cache, v_cache, tables,
                                                lens + 16 * tables.shape[1], 1.0, 0, 0.0)
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[1]
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.aserve.paged_decode_attention(torch.empty_like(query), query, k_cache, v_cache, bad, lens,
                                                1.0, 0, 0.0)


def torch_path(fn):
    """Run `fn` with the kernels switched off: the reference."""
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "usable", lambda *tensors: False)
        return fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_rotary_and_silu_match_torch_path(dtype):
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(40, 1e-6)
    norm.weight.data = torch.randn(40, generator=gen)
    norm = norm.to(dtype)
    x = torch.randn(7, 40, generator=gen).to(dtype)
    x3 = torch.randn(5, 3, 40, generator=gen).to(dtype)[:, :2]  # a strided [T, H, D] view, as Qwen3's q_norm gets
    gate_up = torch.randn(9, 2 * 24, generator=gen).to(dtype)
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    with torch.inference_mode():
        for fn in (lambda: norm(x), lambda: norm(x3), lambda: silu_and_mul(gate_up)):
            torch.testing.assert_close(fn(), torch_path(fn), **tol)
        positions = torch.tensor([0, 1, 5, 17, 200, 3])
        for rotary_dim in (None, 16):  # full and partial (Phi-3) rotation
            rope = RotaryEmbedding(32, 256, 10000.0, {"rope_type": "default"}, dtype, rotary_dim=rotary_dim)
            qkv = torch.randn(6, 4 * 32 + 2 * 2 * 32, generator=gen).to(dtype)
            q, k = qkv[:, :128].view(6, 4, 32), qkv[:, 128:192].view(6, 2, 32)  # strided views of one matmul
            want_q, want_k = torch_path(lambda: rope(positions, q.clone(), k.clone()))
            got_q, got_k = rope(positions, q, k)
            torch.testing.assert_close(got_q, want_q, **tol)
            torch.testing.assert_close(got_k, want_k, **tol)
            torch.testing.assert_close(qkv[:, :128].view(6, 4, 32), want_q, **tol)  # in place, into the matmul output
        # the residual add fused into the norm: the same (normed, sum), the sum written into the residual
        residual = torch.randn(7, 40, generator=gen).to(dtype)
        want_normed, want_sum = torch_path(lambda: norm(x, residual.clone()))
        got_normed, got_sum = norm(x, residual)
        assert got_sum is residual
        torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=0)  # one rounding of the same sum
        torch.testing.assert_close(got_normed, want_normed, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [768, 40])  # whole vectors, and a tail
def test_add_layer_norm_matches_torch_path(dtype, dim):
    """An encoder's post-norm, LayerNorm(x + residual), written over x; the sum rounded to the dtype first, as the
    torch path's add rounds it. Rows of x strided (a slice of a wider product)."""
    gen = torch.Generator().manual_seed(dim)
    norm = torch.nn.LayerNorm(dim, eps=1e-12)
    norm.weight.data, norm.bias.data = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    norm = norm.to(dtype)
    wide = (torch.randn(9, dim + 8, generator=gen) * 3 + 1).to(dtype)
    x, residual = wide[:, :dim], torch.randn(9, dim, generator=gen).to(dtype)
    with torch.inference_mode():
        want = torch_path(lambda: add_layer_norm(x.clone(), residual, norm))
        got = add_layer_norm(x, residual, norm)
    assert got.data_ptr() == wide.data_ptr()  # in place
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got, want, **tol)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.aserve.add_layer_norm(x, residual, norm.weight, norm.bias[:-1], 1e-12)


def test_kernels_are_built_per_cpu_kind(monkeypatch):
    """A different CPU feature set (or torch) must get its own build: -march=native code can crash elsewhere."""
    here = cpu_kernels.build_dir()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "fpu sse sse2 avx avx2")
    assert cpu_kernels.build_dir() != here


def test_a_build_that_loaded_once_is_loaded_again_without_the_build_tools():
    """Start-up: once a build has loaded (the conftest's session start loads it), a new process loads its library
    directly, without torch.utils.cpp_extension (setuptools) or a ninja run; the kernels work."""
    assert cpu_kernels.available() and (cpu_kernels.build_dir() / "built").exists()
    script = ("import sys, torch\nfrom aserve.ops import cpu_kernels\nassert cpu_kernels.available()\n"
              "assert 'torch.utils.cpp_extension' not in sys.modules, 'the build tools were imported'\n"
              "x = torch.randn(3, 64)\n"
              "torch.testing.assert_close(torch.ops.aserve.rms_norm(x, torch.ones(64), 1e-6),\n"
              "                           x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_compiler_falls_back_to_the_torch_path(tmp_path):
    """Without a working compiler the build fails once, with one warning, and the engine runs on the torch path."""
    script = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
              "from aserve.ops import cpu_kernels\n"
              "assert not cpu_kernels.available()\n"
              "from aserve import LLM, SamplingParams\n"
              "out = LLM(dtype='float32').generate(['Hello'], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)\n"
              "assert len(out[0].outputs[0].token_ids) == 3\n")
    env = {**os.environ, "CXX": "/bin/false", "ASERVE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("CPU kernels are unavailable") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_int8_linear_matches_the_dequantized_product(dtype, rows):
    """The tiled int8 kernel: output widths that end mid-tile (33) or on one (48), an odd input width (37), and
    enough tiles (13) for whole groups of tiles at once (prefetching the next) and a remainder; bf16 rows of a
    multiple of 64 inputs (64, 192) take vpdpwssd."""
    from aserve.quantization.int8 import codes, quantize_per_channel, tile

    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(rows)
    for out_features, in_features in ((33, 37), (48, 64), (200, 37), (200, 192)):
        q, scale = quantize_per_channel(torch.randn(out_features, in_features, generator=gen), dtype)
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        tiled = tile(q)
        got = torch.ops.aserve.int8_linear(x, tiled, scale, out_features)
        expected = (x.float() @ q.float().t()) * scale.float()
        torch.testing.assert_close(got.float(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-5 * float(expected.abs().max()) if dtype == torch.float32 else
                                   1e-2 * float(expected.abs().max()))
        untiled = torch.ops.aserve.int8_untile(tiled, out_features, x)
        assert untiled.dtype == dtype and torch.equal(untiled.float(), q.float())
        holder = torch.nn.Module()
        holder.qweight, holder.int8_tiled, holder.out_features = tiled, True, out_features
        assert torch.equal(codes(holder), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_int8_matches_the_dequantized_product(dtype):
    """The int8 GEMM of large batches: output widths that end mid-tile and mid-panel (33, 200), odd input widths, a
    batch over one row block (300 rows of 3001 inputs), inputs past the fp32 GEMM's k chunk (2101), several row
    slices over several panels a thread (on AMX tiles the next panel is widened while one multiplies: 300 x 576 at
    64 rows), with and without a bias (added after the scale)."""
    from aserve.quantization.int8 import gemm_dtypes, quantize_per_channel, tile

    if dtype not in gemm_dtypes():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")
    gen = torch.Generator().manual_seed(5)
    for out_features, in_features, rows in ((33, 37, 9), (200, 64, 70), (48, 2101, 20), (100, 3001, 300), (64, 3, 13),
                                            (300, 576, 64)):
        q, scale = quantize_per_channel(torch.randn(out_features, in_features, generator=gen), dtype)
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        for bias in (None, torch.randn(out_features, generator=gen).to(dtype)):
            got = torch.ops.aserve.gemm_int8(x, tile(q), scale, bias, out_features)
            expected = (x.float() @ q.float().t()) * scale.float() + (0 if bias is None else bias.float())
            assert got.dtype == dtype and got.shape == (rows, out_features)
            bound = float(expected.abs().max()) * (1e-5 if dtype == torch.float32 else 4e-3)
            assert (got.float() - expected).abs().max() <= bound, (out_features, in_features, rows)
    with pytest.raises(RuntimeError, match="int8 tiles"):
        torch.ops.aserve.gemm_int8(x, tile(q)[:, :-1], scale, None, out_features)


@pytest.mark.parametrize("rows", [1, 13, 33, 64, 131])  # one AMX slice, several (widening ahead), row blocks
@pytest.mark.parametrize("inner,in_features", [(16, 33), (48, 576), (96, 1536)])
def test_gemm_int8_applies_silu_and_mul_to_gated_tiles(rows, inner, in_features):
    """A gate | up weight's int8 codes and scales reordered 16 gates, then their 16 ups (cpu_gemm.interleave_gates):
    gemm_int8's SiLU-and-mul epilogue equals silu(gate) * up of the dequantized product in float64 to bf16 precision;
    the row kernel's product of the same tiles, combined by silu_and_mul's blocks of 16, is as near; the plain
    product is the ungated tiles' with its columns interleaved, bit for bit. fp32 rows give the separate path's bits
    (the plain product, then silu_and_mul's blocks of 16); gate | up widths that are not whole panels are refused."""
    from aserve.ops.cpu_gemm import GATE_ROWS, SILU_AND_MUL, interleave_gates
    from aserve.quantization.int8 import gemm_dtypes, quantize_per_channel, tile

    if torch.bfloat16 not in gemm_dtypes():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")
    gen = torch.Generator().manual_seed(rows + inner)
    weight = torch.randn(2 * inner, in_features, generator=gen) * 2 / in_features ** 0.5
    q, scale = quantize_per_channel(weight, torch.bfloat16)
    tiles, scales = tile(interleave_gates(q)), interleave_gates(scale)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    product = x.double() @ (q.double() * scale.double()[:, None]).t()
    expected = torch.nn.functional.silu(product[:, :inner]) * product[:, inner:]
    got = torch.ops.aserve.gemm_int8(x, tiles, scales, None, 2 * inner, SILU_AND_MUL)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inner)
    torch.testing.assert_close(got.double(), expected, atol=2e-3, rtol=2 ** -7)
    if rows <= 8:
        row_kernel = torch.ops.aserve.int8_linear(x, tiles, scales, 2 * inner)
        combined = torch.ops.aserve.silu_and_mul(row_kernel, GATE_ROWS).double()
        torch.testing.assert_close(combined, expected, atol=4e-3, rtol=2 ** -6)
    plain = torch.ops.aserve.gemm_int8(x, tiles, scales, None, 2 * inner)
    assert torch.equal(plain, interleave_gates(torch.ops.aserve.gemm_int8(x, tile(q), scale, None, 2 * inner).t()).t())
    fp32_plain = torch.ops.aserve.gemm_int8(x.float(), tiles, scales.float(), None, 2 * inner)
    assert torch.equal(torch.ops.aserve.gemm_int8(x.float(), tiles, scales.float(), None, 2 * inner, SILU_AND_MUL),
                       torch.ops.aserve.silu_and_mul(fp32_plain, GATE_ROWS))
    with pytest.raises(RuntimeError, match="whole pairs of 16-row panels"):
        torch.ops.aserve.gemm_int8(x, tile(q[:-16]), scale[:-16], None, 2 * inner - 16, SILU_AND_MUL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_takes_gates_and_ups_in_alternate_blocks(dtype):
    """block 16: x alternates 16 gates and their 16 ups; the same values as gate | up halves give, bit for bit;
    a block that does not divide the width is refused."""
    from aserve.ops.cpu_gemm import interleave_gates

    assert cpu_kernels.available()
    x = torch.randn(5, 2 * 96).to(dtype)
    halves = torch.ops.aserve.silu_and_mul(x)
    assert torch.equal(torch.ops.aserve.silu_and_mul(interleave_gates(x.t()).t().contiguous(), 16), halves)
    with pytest.raises(RuntimeError, match="block must be 0"):
        torch.ops.aserve.silu_and_mul(x, 40)


@pytest.mark.parametrize("dtype,products", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.bfloat16, "dpbf16"), (torch.bfloat16, "fma")])
def test_int4_kernels_match_the_dequantized_product(request, dtype, products):
    """GPTQ/AWQ layers on aserve's int4 kernels: int4_linear (1-16 rows) and gemm_int4 (any rows) equal x @ (q * s -
    s * z)^T with the stored (fp16) s and z, for group sizes 24/32/64/128 and a whole row, output widths
    that end mid-tile and mid-panel, inputs that end mid-way through 16 (72), a batch over one row block, inputs
    past the fp32 GEMM's k chunk, and several row slices over several panels a thread (the AMX GEMM's widening
    ahead, 200 x 576 and 130 x 1536); bf16 on each of the CPU's products (gemm_int4 on FMAs takes a tile at a time,
    up to 24 rows at once, in row blocks: 70 rows of 4224 are two); both kernels the same for rows that are a view
    into wider ones. Where int4_linear makes x 16-bit integers (int4_row_products), its product is the rounded x's."""
    from aserve.quantization.int4 import int4_row_products, tile_int4, tile_scales_zeros
    from aserve.quantization.int8 import gemm_dtypes

    if dtype not in gemm_dtypes():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")
    if products is not None:
        request.getfixturevalue("bf16_products")(products)
    gen = torch.Generator().manual_seed(7)
    for out_features, in_features, group, rows in ((33, 64, 32, 1), (200, 128, 64, 3), (48, 576, 64, 8),
                                                   (100, 4224, 64, 70), (40, 96, 96, 300), (64, 1536, 128, 5),
                                                   (33, 72, 24, 9), (200, 576, 64, 70), (130, 1536, 128, 131),
                                                   (72, 192, 24, 2), (40, 192, 96, 4)):
        groups = in_features // group
        codes = torch.randint(0, 16, (out_features, in_features), generator=gen)
        scales = torch.rand(groups, out_features, generator=gen) * 0.1
        zeros = torch.randint(0, 16, (groups, out_features), generator=gen).float()
        tiles, sz = tile_int4(codes), tile_scales_zeros(scales, zeros)
        s, sz_term = (t.float() for t in _stored_scales(sz, out_features))
        g = torch.arange(in_features) // group
        weight = codes.float() * s[g].t() - sz_term[g].t()
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        bias = torch.randn(out_features, generator=gen).to(dtype)
        expected = x.float() @ weight.t()
        bound = float(expected.abs().max()) * (1e-5 if dtype == torch.float32 else 8e-3)
        # rows read where they are: a view one element into wider rows (an odd offset and stride)
        wide = torch.zeros(rows, in_features + 3, dtype=dtype)
        wide[:, 1:in_features + 1] = x
        view = wide[:, 1:in_features + 1]
        if rows <= 16:
            got = torch.ops.aserve.int4_linear(x, tiles, sz, group, out_features)
            rows_expected = expected
            if int4_row_products(dtype, rows) in ("vpmaddwd", "vpdpwssd"):
                rows_expected = (_fixed_point(x.double(), group) @ weight.double().t()).float()
            assert got.dtype == dtype and (got.float() - rows_expected).abs().max() <= bound, (out_features, rows)
            again = torch.ops.aserve.int4_linear(view, tiles, sz, group, out_features)
            assert torch.equal(again, got), (out_features, rows)
        got = torch.ops.aserve.gemm_int4(x, tiles, sz, group, bias, out_features)
        assert got.dtype == dtype and (got.float() - expected - bias.float()).abs().max() <= bound, (out_features, rows)
        again = torch.ops.aserve.gemm_int4(view, tiles, sz, group, bias, out_features)
        assert torch.equal(again, got), (out_features, rows)
    with pytest.raises(RuntimeError, match="group size"):
        torch.ops.aserve.int4_linear(x, tiles, sz, 60, out_features)
    with pytest.raises(RuntimeError, match="takes 1 to 16 rows"):
        torch.ops.aserve.int4_linear(x.new_zeros(17, in_features), tiles, sz, group, out_features)


def _fixed_point(x: torch.Tensor, group: int, span: int = 64) -> torch.Tensor:
    """x (fp64) as int4_linear's integer paths read it: within each group, spans of up to `span` inputs share the
    unit 2^(e - 14), e the exponent of the span's largest |x| (at least -100), and each x is rounded to a whole number
    of units (ties to even), at most 2^15 - 1 (an fp32 x just under 2^(e + 1) rounds to 2^15)."""
    out = torch.empty_like(x)
    for g0 in range(0, x.shape[1], group):
        for s0 in range(g0, g0 + group, span):
            part = x[:, s0:min(s0 + span, g0 + group)]
            e = (torch.frexp(part.abs().amax(1, keepdim=True)).exponent - 1).clamp(min=-100)
            unit = torch.pow(2.0, (e - 14).double())
            out[:, s0:s0 + part.shape[1]] = torch.round(part / unit).clamp(max=2 ** 15 - 1) * unit
    return out


def _stored_scales(sz: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The s and s * z ([groups, out], fp64) of tile_scales_zeros' fp16 scales and zero points, as the kernels read
    them."""
    groups = sz.shape[1]
    s, z = (sz[:, :, i].permute(1, 0, 2).reshape(groups, -1)[:, :out_features].double() for i in (0, 1))
    return s, s * z


def _rows_with_an_outlier(gen, rows: int, in_features: int, group: int) -> torch.Tensor:
    """Random fp32 rows (at least 3) for the integer row kernels' tests: row 1 an outlier at input 0 and the rest 16
    binades below it (rounded in the outlier's span, exact in the others), row 2 a span of zeros and then values near
    fp32's smallest normal."""
    x = torch.randn(rows, in_features, generator=gen)
    x[1, 1:] *= 2.0 ** -6
    x[1, 0] = 2.0 ** 10
    x[2, :min(64, group)] = 0.0
    x[2, min(64, group):] *= 1e-30
    return x


def _int4_layer_with_a_silent_input(gen, out_features: int, in_features: int, group: int):
    """A random int4 layer whose input 0 weighs 8 s - 8 s = 0 exactly (an outlier there leaves the output to the
    small inputs): (codes, tiles, scales_zeros, s, s * z as stored (fp64), each input's group, the weight (fp64))."""
    from aserve.quantization.int4 import tile_int4, tile_scales_zeros

    groups = in_features // group
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen)
    scales = torch.rand(groups, out_features, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (groups, out_features), generator=gen).float()
    zeros[0] = 8
    codes[:, 0] = 8
    tiles, sz = tile_int4(codes), tile_scales_zeros(scales, zeros)
    s, sz_term = _stored_scales(sz, out_features)
    g = torch.arange(in_features) // group
    return codes, tiles, sz, s, sz_term, g, codes.double() * s[g].t() - sz_term[g].t()


def test_int4_bf16_rows_are_16_bit_integers_sharing_a_spans_exponent(bf16_products):
    """int4_linear's bf16 path on vpdpwssd (where bf16 products run on FMAs or AMX tiles) multiplies x made 16-bit
    integers, one exponent per span of 64 inputs: the product of the rounded x to bf16's precision, whatever the
    spread of the x, for a group of two spans, of one short one (96 = 64 + 32) and of less than a span. An input more
    than 7 binades below its span's largest is rounded to half a unit (the outlier row, where the exact product
    differs); zeros and values near fp32's smallest normal are exact; a NaN or an infinity makes its row's outputs
    NaN and leaves the other rows alone."""
    bf16_products("fma")
    gen = torch.Generator().manual_seed(11)
    out_features = 48
    for in_features, group in ((128, 128), (192, 96), (72, 24)):
        codes, tiles, sz, s, sz_term, g, weight = _int4_layer_with_a_silent_input(gen, out_features, in_features,
                                                                                  group)
        x = _rows_with_an_outlier(gen, 4, in_features, group)
        x = x.bfloat16()
        rounded = _fixed_point(x.double(), group)
        expected = rounded @ weight.t()
        got = torch.ops.aserve.int4_linear(x, tiles, sz, group, out_features).double()
        # bf16's rounding of the output, and fp32's of the terms it sums (s q x and s z x: the outlier's cancel)
        bound = 2.0 ** -8 * expected.abs() + 2.0 ** -18 * (rounded.abs() @ (codes * s[g].t() + sz_term[g].t()).t())
        assert ((got - expected).abs() <= bound).all(), in_features
        exact = x.double() @ weight.t()
        assert (exact[1] - expected[1]).abs().max() > 0.1 * float(expected[1].abs().max()), "no input was rounded"
        torch.testing.assert_close(got[0], exact[0], rtol=2 ** -7, atol=1e-3 * float(exact[0].abs().max()))
        for bad in (float("nan"), float("inf")):
            broken = x.clone()
            broken[3, 5] = bad
            again = torch.ops.aserve.int4_linear(broken, tiles, sz, group, out_features)
            assert again[3].isnan().all() and torch.equal(again[:3], got[:3].bfloat16()), (in_features, bad)


def _assert_int4_rows_keep_their_bits(x, tiles, sz, group: int, out_features: int, batch, row_counts) -> None:
    """int4_linear of x's first rows, for each count, is the same bits as those rows of `batch` (x's product); a NaN
    or an infinity in row 4 of 6 makes that row's outputs NaN and leaves the other rows' bits alone."""
    for rows in row_counts:
        got = torch.ops.aserve.int4_linear(x[:rows], tiles, sz, group, out_features)
        assert torch.equal(got, batch[:rows]), (x.shape[1], rows)
    for bad in (float("nan"), float("inf")):
        broken = x[:6].clone()
        broken[4, 5] = bad
        again = torch.ops.aserve.int4_linear(broken, tiles, sz, group, out_features)
        assert again[4].isnan().all() and torch.equal(again[[0, 1, 2, 3, 5]], batch[[0, 1, 2, 3, 5]]), bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_rows_on_vpmaddwd_are_16_bit_integers_sharing_a_spans_exponent(dtype):
    """On AVX2-only CPUs int4_linear multiplies fp32 and bf16 rows alike as 16-bit integers on vpmaddwd, one exponent
    per span of 64 inputs: the product of the rounded x (an fp32 x to 2^-15 of its span's largest, and one just under
    a power of two capped at 2^15 - 1 units, not wrapped) to fp32's rounding of the sums, for groups of one span, of
    two, of one short one and of less than a span. An input 16 binades below its span's largest is rounded; a span
    of zeros, and one of values near fp32's smallest normal, are read as the others are; a row's output is the same
    bits at 1 to 16 rows (blocks of up to 4 rows, each summed alike); a NaN or an infinity makes its row's outputs NaN
    and leaves the other rows alone."""
    from aserve.quantization.int4 import int4_row_products

    if not cpu_kernels.available() or int4_row_products(dtype) != "vpmaddwd":
        pytest.skip("the vpmaddwd rows are AVX2-only CPUs' path")
    gen = torch.Generator().manual_seed(17)
    out_features = 40
    for in_features, group in ((128, 128), (192, 96), (72, 24), (256, 64)):
        codes, tiles, sz, s, sz_term, g, weight = _int4_layer_with_a_silent_input(gen, out_features, in_features,
                                                                                  group)
        x = _rows_with_an_outlier(gen, 16, in_features, group)
        x[3, 1] = 2.0 - 2.0 ** -23  # fp32: 2^15 units, capped at 2^15 - 1
        x = x.to(dtype)
        rounded = _fixed_point(x.double(), group)
        expected = rounded @ weight.t()
        batch = torch.ops.aserve.int4_linear(x, tiles, sz, group, out_features)
        # the output's rounding to its dtype, and fp32's of the terms it sums (s q x and s z x: the outlier's cancel)
        output_rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -22
        bound = output_rounding * expected.abs() + 2.0 ** -18 * (rounded.abs() @ (codes * s[g].t() + sz_term[g].t()).t())
        assert ((batch.double() - expected).abs() <= bound).all(), in_features
        exact = x.double() @ weight.t()
        assert (exact[1] - expected[1]).abs().max() > 0.1 * float(expected[1].abs().max()), "no input was rounded"
        torch.testing.assert_close(batch[0].double(), exact[0], rtol=2 ** -7, atol=1e-3 * float(exact[0].abs().max()))
        _assert_int4_rows_keep_their_bits(x, tiles, sz, group, out_features, batch, (1, 2, 3, 5, 8, 9, 13))


def test_int4_bf16_rows_on_vdpbf16ps_multiply_x_as_it_is(bf16_products):
    """Where bf16 products run on vdpbf16ps, int4_linear multiplies x as it is by each code made 128 + q: the exact
    product x (q * s - s * z) to bf16's rounding of the output and fp32's of the sums of x (128 + q) s (whose 128s
    cancel), for 3 to 16 rows (1 and 2 stay on vpdpwssd), groups of 24, 96 and 128. An input 16 binades below its
    row's largest, which the vpdpwssd path rounds away, counts. A row's output is the same bits at 3 to 16 rows
    (blocks of up to 4 rows on pairs of tiles, each summed in the same order), and a NaN or an infinity makes its
    row's outputs NaN and leaves the others alone."""
    from aserve.quantization.int4 import kernel_rows

    bf16_products("dpbf16")
    assert kernel_rows(torch.bfloat16) == 16 and kernel_rows(torch.float32) == 8
    gen = torch.Generator().manual_seed(13)
    out_features = 40
    for in_features, group in ((192, 24), (192, 96), (256, 128)):
        codes, tiles, sz, s, sz_term, g, weight = _int4_layer_with_a_silent_input(gen, out_features, in_features,
                                                                                  group)
        x = torch.randn(16, in_features, generator=gen)
        x[1, 1:] *= 2.0 ** -16  # beside one large input: 2^-2 of a unit of the vpdpwssd path's span, rounded to 0
        x[1, 0] = 1.0
        x = x.bfloat16()
        exact = x.double() @ weight.t()
        terms = x.double().abs() @ ((codes + 128) * s[g].t() + (sz_term[g] + 128 * s[g]).abs().t()).t()
        bound = 2.0 ** -8 * exact.abs() + 2.0 ** -18 * terms
        batch = torch.ops.aserve.int4_linear(x, tiles, sz, group, out_features)
        assert ((batch.double() - exact).abs() <= bound).all(), in_features
        assert (batch[1].double() - exact[1]).abs().max() <= 0.05 * float(exact[1].abs().max()), in_features
        _assert_int4_rows_keep_their_bits(x, tiles, sz, group, out_features, batch, (3, 4, 5, 8, 9, 13))


@pytest.mark.parametrize("rows", [1, 2, 4, 6])
def test_int8_bf16_rows_are_16_bit_integers_sharing_a_spans_exponent(rows):
    """int8_linear's bf16 path (vpdpwssd, rows of a multiple of 64 inputs) multiplies x made 16-bit integers, one
    exponent per span of 64 inputs of the row, as int4_linear does: the product of the rounded x to bf16's precision;
    an input 16 binades below its span's largest is rounded (the exact product differs there); a NaN or an infinity
    makes its row's outputs NaN and leaves the other rows alone."""
    from aserve.quantization.int8 import tile

    if not hasattr(torch.ops.aserve, "gemm_packs_bf16") or not torch.ops.aserve.gemm_packs_bf16():
        pytest.skip("the bf16 kernels need AVX512-BF16")
    gen = torch.Generator().manual_seed(5)
    out_features, in_features = 40, 192
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    q[:, 0] = 0  # the outlier input weighs nothing: the output is the small inputs'
    scale = (torch.rand(out_features, generator=gen) * 0.01 + 0.001).bfloat16()
    weight = q.double() * scale.double()[:, None]
    x = _rows_with_an_outlier(gen, max(rows, 4), in_features, in_features)
    x = x[:rows].bfloat16()
    rounded = _fixed_point(x.double(), in_features)
    expected = rounded @ weight.t()
    got = torch.ops.aserve.int8_linear(x, tile(q), scale, out_features).double()
    bound = 2.0 ** -8 * expected.abs() + 2.0 ** -18 * (rounded.abs() @ weight.abs().t())
    assert ((got - expected).abs() <= bound).all()
    if rows > 1:
        exact = x.double() @ weight.t()
        assert (exact[1] - expected[1]).abs().max() > 0.1 * float(expected[1].abs().max()), "no input was rounded"
        broken = x.clone()
        broken[rows - 1, 5] = float("nan") if rows % 2 else float("inf")
        again = torch.ops.aserve.int8_linear(broken, tile(q), scale, out_features)
        assert again[rows - 1].isnan().all() and torch.equal(again[:rows - 1], got[:rows - 1].bfloat16())


def test_sample_inverse_cdf_draws_what_softmax_cumsum_searchsorted_draws():
    """The fused draw picks the token the torch path picks for the same uniforms (away from the rounding edges
    between two tokens), masked (-inf) entries never, and a draw at the very top lands on the last live token."""
    from aserve.worker.sampler import draw

    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1003, generator=gen) * 3
    logits[:, 500:] = float("-inf")  # as a grammar's bitmask leaves them
    logits[1, :] = float("-inf")
    logits[1, 7] = 0.0
    uniforms = torch.rand(64, generator=gen)
    cdf = logits.softmax(-1).cumsum(-1)
    reference = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    with torch.inference_mode():
        fused = torch.ops.aserve.sample_inverse_cdf(logits, uniforms)
        assert torch.equal(draw(logits, uniforms), fused)  # the sampler takes the kernel where it can
    edge = (cdf - (uniforms * cdf[:, -1]).unsqueeze(1)).abs().min(dim=1).values < 1e-5
    assert ((fused == reference) | edge).all() and (~edge).sum() > 50
    assert (fused < 500).all() and fused[1] == 7
    top = torch.ops.aserve.sample_inverse_cdf(logits[:2], torch.ones(2))
    assert top.tolist() == [499, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_count_nonfinite_rows_counts_what_isfinite_finds(dtype):
    """A NaN, +inf or -inf anywhere in a row (the vector body or the scalar tail) makes it count; large finite
    values do not; rows read with their stride. The sampler's unusable_rows gives the exact rows either way."""
    from aserve.worker.sampler import unusable_rows

    assert cpu_kernels.available()
    big = torch.finfo(dtype).max
    logits = torch.randn(10, 1003).to(dtype)
    logits[0, 5] = float("nan")
    logits[1, 1001] = float("inf")  # in the tail
    logits[2, 17] = float("-inf")  # masked, still usable
    logits[3, :] = float("-inf")  # nothing to sample
    logits[4, :] = big  # finite: its products with 0 are 0, no overflow
    logits[5, 1002] = float("nan")
    wide = torch.zeros(10, 1100, dtype=dtype)
    wide[:, :1003] = logits
    with torch.inference_mode():
        for rows in (logits, wide[:, :1003]):
            assert torch.ops.aserve.count_nonfinite_rows(rows) == int((~torch.isfinite(rows.float())).any(1).sum()) == 5
            assert unusable_rows(rows) == [0, 1, 3, 5]
            assert torch.ops.aserve.count_nonfinite_rows(rows[6:]) == 0 and unusable_rows(rows[6:]) == []
    with pytest.raises(RuntimeError, match="unit inner stride"):
        torch.ops.aserve.count_nonfinite_rows(logits.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_torch_argmax(dtype):
    """The first of equal maxima, as torch.argmax gives it: ties within a vector lane and across lanes, the max in
    the scalar tail or first, -inf and +inf entries, all -inf, NaN anywhere (torch: the first NaN), short rows,
    strided rows; and the sampler's greedy tokens take it."""
    from aserve.worker.sampler import greedy

    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(2)
    wide = (torch.randn(24, 1100, generator=gen) * 3).to(dtype)
    rows = wide[:, :1003]
    rows[0, :] = 1.0  # all equal: index 0
    rows[1, 40] = rows[1, 7] = rows[1, 990] = 50.0  # ties in different lanes and vectors
    rows[2, 1001] = 60.0  # in the tail
    rows[3, 0] = 70.0
    rows[4, :] = float("-inf")
    rows[5, 300] = float("inf")
    rows[6, 300] = float("inf")
    rows[6, 20] = float("inf")
    rows[7, 900] = float("nan")
    rows[8, 2] = float("nan")
    rows[8, 500] = float("nan")
    rows[9, 1002] = float("nan")
    rows[10, 17:33] = 80.0  # one whole vector of equal maxima
    rows[11, :500] = float("-inf")
    with torch.inference_mode():
        for x in (rows, rows.contiguous(), rows[:, :5], rows[:, :16], rows[:, :17], rows[:, :1]):
            assert torch.equal(torch.ops.aserve.argmax_rows(x), x.argmax(dim=-1)), x.shape
            assert torch.equal(greedy(x), x.argmax(dim=-1))
        assert torch.ops.aserve.argmax_rows(rows[:0]).shape == (0,)
    with pytest.raises(RuntimeError, match="unit inner stride"):
        torch.ops.aserve.argmax_rows(rows.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_is_argmax_with_unusable_rows_marked(dtype):
    """greedy_rows: torch's argmax where a row can be sampled from, -1 where unusable_rows finds it cannot (a NaN
    or +inf anywhere, every value -inf); -inf entries beside finite ones are usable. The body, the tail, short and
    strided rows."""
    from aserve.worker.sampler import unusable_rows

    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(3)
    wide = (torch.randn(12, 1100, generator=gen) * 3).to(dtype)
    rows = wide[:, :1003]
    rows[0, 40] = rows[0, 990] = 50.0  # a tie: the first
    rows[1, :] = float("-inf")
    rows[2, 300] = float("inf")
    rows[3, 900] = float("nan")
    rows[4, 1002] = float("nan")  # in the tail
    rows[5, :500] = float("-inf")  # masked, still usable
    rows[6, 1001] = float("inf")
    rows[7, 1:] = float("-inf")  # one value left
    with torch.inference_mode():
        for x in (rows, rows.contiguous(), rows[:, :5], rows[:, :16], rows[:, :17], rows[:, :1]):
            expected = x.argmax(dim=-1)
            expected[unusable_rows(x)] = -1
            assert torch.equal(torch.ops.aserve.greedy_rows(x), expected), x.shape
        assert torch.ops.aserve.greedy_rows(rows)[:8].tolist() == [40, -1, -1, -1, -1, rows[5].argmax().item(), -1, 0]
    with pytest.raises(RuntimeError, match="unit inner stride"):
        torch.ops.aserve.greedy_rows(rows.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sample_inverse_cdf_reads_16_bit_logits_as_their_fp32_widening(dtype):
    """16-bit logits are drawn from in place: the same tokens as from their exact fp32 copy, masked entries and
    a vocabulary that is not a multiple of the vector width included."""
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(48, 1003, generator=gen) * 4).to(dtype)
    logits[:, 900:] = float("-inf")
    logits[3, :] = float("-inf")
    logits[3, 1001] = 2.0  # the only live token sits in the scalar tail
    uniforms = torch.rand(48, generator=gen)
    with torch.inference_mode():
        drawn = torch.ops.aserve.sample_inverse_cdf(logits, uniforms)
        assert torch.equal(drawn, torch.ops.aserve.sample_inverse_cdf(logits.float(), uniforms))
    assert drawn[3] == 1001 and (drawn[torch.arange(48) != 3] < 900).all()


def stable_sort_filter(x: torch.Tensor, top_k, top_p, min_p) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's sorted path over a stable sort (equal values in their indices' order) in float64: each row's
    kept tokens, and each token's distance from a cut (its exclusive running sum from top_p, its probability from
    min_p's bound), so that a test can leave out the tokens within rounding of one."""
    from aserve.worker.sampler import _drops

    x = x.double()
    ranked, order = x.sort(dim=-1, descending=True, stable=True)
    col = lambda v, dtype: torch.tensor(v, dtype=dtype).unsqueeze(1)  # noqa: E731
    k, p, m = col(top_k, torch.long), col(top_p, torch.float64), col(min_p, torch.float64)
    kept_sorted, _, _ = _drops(ranked, k, p, m, None)
    probs = ranked.masked_fill(torch.arange(x.shape[1]) >= k, float("-inf")).softmax(dim=-1)
    margin = torch.minimum(torch.where(p < 1, ((probs.cumsum(-1) - probs) - p).abs(), 1.0),
                           torch.where(m > 0, (probs - m * probs[:, :1]).abs(), 1.0))
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, kept_sorted > float("-inf"))
    return kept, torch.empty_like(margin).scatter_(1, order, margin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_filter_rows_keeps_what_a_stable_sort_keeps(dtype):
    """filter_rows (top-k, top-p and min-p by radix select, no sort) keeps the tokens the sampler's sorted path keeps
    over a stable sort: flat rows (most of the row kept), peaked ones, 16-bit rows full of equal values (ties at
    every cut: the first ones by index, so top_k = 1 keeps argmax's token), -inf entries, top_k past the finite
    values, vocabularies from 1 to 49152, strided rows. Tokens within 1e-5 of a cut's rounding are left out of
    the comparison. A row with a NaN or no finite max comes back as it was."""
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(4)
    options = [(None, 0.9, 0.0), (20, 1.0, 0.0), (1, 1.0, 0.0), (1500, 0.95, 0.0), (None, 0.5, 0.0),
               (None, 1.0, 0.05), (300, 0.99, 0.01), (None, 1e-6, 0.0), (None, 0.999, 0.0), (7, 0.3, 0.2)]
    compared = 0
    for spread, vocab in [(0.05, 49152), (0.5, 32000), (3, 4096), (15, 1003), (1, 17), (1, 2), (1, 1)]:
        wide = (torch.randn(len(options), vocab + 5, generator=gen) * spread).to(dtype)
        x = wide[:, :vocab]  # rows `vocab + 5` apart
        if vocab > 100:
            x[3, :vocab // 2] = float("-inf")
            x[4, 10:20] = x[4].max()  # tied maxima
        top_k = [min(k or vocab, vocab) for k, _, _ in options]
        top_p = [p for _, p, _ in options]
        min_p = [m for _, _, m in options]
        with torch.inference_mode():
            out = torch.ops.aserve.filter_rows(x, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
        assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
        ours = torch.isfinite(out)
        assert torch.equal(out[ours], x[ours])  # kept tokens keep their logits; the rest are -inf
        kept, margin = stable_sort_filter(x.float(), top_k, top_p, min_p)
        clear = margin > 1e-5
        assert torch.equal(ours[clear], kept[clear]), (spread, vocab)
        compared += int(clear.sum())
        assert torch.isfinite(out[2]).sum() == 1 and out[2].argmax() == x[2].argmax()  # top_k = 1
        assert int(torch.isfinite(out[1]).sum()) == min(20, int(torch.isfinite(x[1]).sum()))  # exactly k, ties too
    assert compared > 0.99 * len(options) * (49152 + 32000 + 4096 + 1003 + 17 + 2 + 1)
    odd = torch.zeros(3, 50, dtype=dtype)
    odd[0] = float("-inf")
    odd[1, 7] = float("nan")
    odd[2, 3] = float("inf")
    one = torch.ones(3)
    with torch.inference_mode():
        back = torch.ops.aserve.filter_rows(odd, torch.full((3,), 5), one * 0.5, one * 0)
    assert torch.equal(back.isnan(), odd.isnan()) and torch.equal(back[~odd.isnan()], odd[~odd.isnan()])
    with pytest.raises(RuntimeError, match="one value a row"):
        torch.ops.aserve.filter_rows(odd, torch.full((2,), 5), one * 0.5, one * 0)
    with pytest.raises(RuntimeError, match="top_k must be at least 1"):
        torch.ops.aserve.filter_rows(odd, torch.zeros(3, dtype=torch.long), one * 0.5, one * 0)


def test_apply_penalties_refuses_what_would_write_outside_its_rows():
    """The penalties kernel writes where its lists say: a token outside the vocabulary, a row out of range or twice,
    or lengths that do not add up to the lists are refused before anything is written (the sampler's bits against
    the whole-vocabulary formula are tests/test_engine.py's)."""
    assert cpu_kernels.available()
    logits = torch.zeros(3, 10)
    penalty = torch.tensor([[1.5, 0.5, 0.25], [2.0, 0.0, 0.0]])

    def call(rows=(0, 2), prompt=(1, 2, 9), prompt_lengths=(2, 1), output=(3, 3), output_lengths=(2, 0)):
        t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        torch.ops.aserve.apply_penalties(logits, t(rows), t(prompt), t(prompt_lengths), t(output), t(output_lengths),
                                         penalty)
    for bad, match in [(dict(prompt=(1, 2, 10)), "outside the vocabulary"), (dict(output=(3, -1)), "outside"),
                       (dict(rows=(0, 3)), "out of range"), (dict(rows=(2, 2)), "listed twice"),
                       (dict(prompt_lengths=(2, 2)), "add up"), (dict(output_lengths=(2,)), "one length a row")]:
        with pytest.raises(RuntimeError, match=match):
            call(**bad)
        assert not logits.any()
    logits[0] = 1.0
    call()
    # row 0: tokens 1 and 2 from the prompt (1 / 1.5), token 3 twice in the output (1 / 1.5 - 0.5 * 2 - 0.25)
    assert torch.equal(logits[0, :4], torch.tensor([1.0, 1 / 1.5, 1 / 1.5, 1 / 1.5 - 1.0 - 0.25]))
    assert logits[2, 9] == 0.0 and not logits[1].any()


def test_sampler_draws_from_16_bit_logits_without_an_fp32_copy(monkeypatch):
    """Greedy rows and plain temperature-1 draws take bf16 logits as they are (the same tokens as from fp32); a
    batch with any row that rewrites its logits (temperature, penalties, logprobs, min_tokens) gets the fp32 copy."""
    from aserve.sampling_params import SamplingParams
    from aserve.worker import sampler
    from aserve.worker.request_state import RequestState

    def states(params):
        return [RequestState(f"r{i}", [1, 2, 3], p.clone(seed=i)) for i, p in enumerate(params)]

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 4001, generator=gen) * 3).bfloat16()
    plain = [SamplingParams(temperature=1.0)] * 4 + [SamplingParams(temperature=0)] * 2
    converted = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda self: converted.append(self.shape) or real_float(self))
    with torch.inference_mode():
        fast = [r.token_id for r in sampler.sample(logits, states(plain))]
        assert converted == []
        assert fast == [r.token_id for r in sampler.sample(logits.float(), states(plain))]
        for odd in (SamplingParams(temperature=0.7), SamplingParams(repetition_penalty=1.2),
                    SamplingParams(logprobs=2), SamplingParams(min_tokens=3), SamplingParams(top_p=0.9)):
            converted.clear()
            sampler.sample(logits, states(plain[:5] + [odd]))
            assert converted and converted[0] == logits.shape, odd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 30.0)])
def test_backend_kernels_match_the_torch_path(monkeypatch, dtype, block_size, window, softcap):
    """One step of decode rows and prefill chunks alone and after cached context, through the backend: its
    kernels (decode, prefill) in `dtype` against its torch path (gather + matmuls, SDPA) in fp32, from the same
    rounded inputs."""
    from types import SimpleNamespace

    from aserve.attention import torch_backend
    from conftest import make_layout

    requests = [(0, 1), (3, 1), (40, 1), (0, 9), (21, 6), (5, 19), (30, 12)]
    gen = torch.Generator().manual_seed(block_size)
    layout = make_layout(requests, block_size, gen)
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    layer = SimpleNamespace(scale=head_dim ** -0.5, sliding_window=window, logit_softcap=softcap, k_scale=1.0,
                            v_scale=1.0, causal=True)
    tokens = len(layout.positions)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    key, value = (torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    shape = torch_backend.TorchAttentionBackend().kv_cache_shape(1, layout.num_physical_blocks, block_size,
                                                                 num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)  # stale values: only the lengths keep them out
    outs = {}
    for kind, kernels in ((dtype, True), (torch.float32, False)):
        monkeypatch.setattr(cpu_kernels, "usable", (lambda *t: True) if kernels else (lambda *t: False))
        backend = torch_backend.TorchAttentionBackend()
        kv = cache.to(kind, copy=True)
        meta = backend.build_metadata(layout, num_kv_heads)
        assert (meta.num_decode_tokens, len(meta.prefills)) == (3, 4)
        with torch.inference_mode():
            outs[kernels] = backend.forward(layer, query.to(kind), key.to(kind), value.to(kind),
                                            (kv[0, 0], kv[0, 1]), meta).float()
    tol = TOL[dtype]
    torch.testing.assert_close(outs[True], outs[False], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("window", [None, 7])
def test_short_chunks_run_as_decode_rows_with_the_same_result(monkeypatch, dtype, kernels, window):
    """Short chunks past their prompts (speculative decoding's checked proposals), placed after the decodes as the
    runner orders them, run as one decode row per token; the output is what the prefill path gives them. A short
    chunk of a prompt (the tail after a prefix-cache hit) goes to the prefill kernel with the rest."""
    from types import SimpleNamespace

    from aserve.attention import backend as attention_backend, torch_backend
    from conftest import make_layout

    requests = [(3, 1), (40, 1), (21, 6), (30, 5), (17, 8), (0, 9), (5, 19), (12, 4)]
    prompts = [3, 40, 21, 30, 17, 9, 24, 16]
    orders = [attention_backend.batch_order(n, start, prompt) for (start, n), prompt in zip(requests, prompts)]
    assert orders == [0, 0, 1, 1, 1, 2, 2, 2]
    assert attention_backend.batch_order(1, 15, 16) == 2  # a prompt's last token, the rest of it cached
    layouts = {short: make_layout(requests, 16, torch.Generator().manual_seed(5), orders.count(1) if short else 0)
               for short in (True, False)}
    layout = layouts[True]
    gen = torch.Generator().manual_seed(6)
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    layer = SimpleNamespace(scale=head_dim ** -0.5, sliding_window=window, logit_softcap=None, k_scale=1.0,
                            v_scale=1.0, causal=True)
    tokens = len(layout.positions)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    key, value = (torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    backend = torch_backend.TorchAttentionBackend()
    shape = backend.kv_cache_shape(1, layout.num_physical_blocks, 16, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    monkeypatch.setattr(cpu_kernels, "usable", (lambda *t: True) if kernels else (lambda *t: False))
    outs = {}
    for short in (True, False):
        meta = backend.build_metadata(layouts[short], num_kv_heads)
        assert (meta.num_decode_tokens, len(meta.prefills)) == ((2 + 6 + 5 + 8, 3) if short else (2, 6))
        kv = cache.clone()
        with torch.inference_mode():
            outs[short] = backend.forward(layer, query, key, value, (kv[0, 0], kv[0, 1]), meta).float()
    tol = TOL[dtype]
    torch.testing.assert_close(outs[True], outs[False], atol=tol, rtol=tol)
