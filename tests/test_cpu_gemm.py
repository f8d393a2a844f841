"""Prepacked linear layers compute what nn.Linear computes, and swap in without changing the model's state."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from aserve import LLM, SamplingParams
from aserve.ops.cpu_gemm import PackedLinear, can_pack, prepack_linears
from conftest import random_prompts

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
NO_BF16_PACKING = "oneDNN packs bf16 only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks"
# A 16-bit dtype where this CPU packs one, else float32: the engine test below runs on every CPU kind.
PACK_DTYPE = torch.bfloat16 if can_pack(torch.bfloat16) else torch.float32


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])  # sums in another order
def test_packed_linear_equals_linear(bias, rows, dtype, tol):
    if not can_pack(dtype):
        pytest.skip(NO_BF16_PACKING)
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    expected = linear(x).float()
    got = PackedLinear.of(linear)(x).float()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_prepack_swaps_the_linears_of_the_dtype_and_keeps_the_parameters():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), nn.Linear(4, 4).to(torch.bfloat16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert prepack_linears(model, torch.float32) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert type(model[2]) is nn.Linear  # another dtype: left alone
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert prepack_linears(nn.Sequential(nn.Linear(2, 2)), torch.float64) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prepack_packs_16_bit_weights_only_where_onednn_can(dtype):
    """On an AVX2-only CPU oneDNN refuses to reorder 16-bit weights (it raises): prepacking must leave them as
    nn.Linear, still computing, rather than fail the load. Where it can, they are packed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)).to(dtype)
    x = torch.randn(3, 16, dtype=dtype)
    expected = model(x).float()
    packed = prepack_linears(model, dtype)
    assert packed == (2 if can_pack(dtype) else 0)
    assert all(type(layer) is (PackedLinear if packed else nn.Linear) for layer in model)
    torch.testing.assert_close(model(x).float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", ["llama-untied", "llama-gqa-tied"])
def test_an_engine_with_packed_weights_gives_the_same_logprobs(model_dirs, monkeypatch, family):
    """The same engine before and after packing (forced here, in bf16 even where bf16 is emulated if oneDNN can
    pack it, else in fp32), with an untied head (a Linear) and a tied one (the embedding, packed apart): the
    chosen token's logprob agrees to bf16 precision."""
    monkeypatch.setenv("ASERVE_PREPACK", "0")
    llm = LLM(str(model_dirs[family]), dtype=str(PACK_DTYPE).replace("torch.", ""), kv_cache_memory="16MiB",
              enable_prefix_caching=False, device="cpu")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, lengths=(5, 30), seed=7)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    plain = llm.generate(prompts, params, use_tqdm=False)
    model = llm.engine.runner.model
    assert prepack_linears(model, PACK_DTYPE) == 4 * 2 + 1  # qkv, o, gate_up, down per layer, and the head
    assert (model.packed_head is not None) == (model.lm_head is None)
    packed = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, packed):
        token = a.outputs[0].token_ids[0]
        top_a, top_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert token in top_b and abs(top_b[token].logprob - top_a[token].logprob) < 0.05
    llm.engine.check_idle()


@pytest.fixture
def aserve_gemm(pick_gemm):
    """aserve's GEMM chosen for this test (the default where the kernels are built), whatever the environment."""
    from aserve.ops import cpu_kernels

    if not (cpu_kernels.available() and hasattr(torch.ops.aserve, "gemm_packed")):
        pytest.skip("aserve's GEMM is not built here (no compiler, or a CPU without AVX2 and FMA)")
    pick_gemm("aserve")


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 16, 25, 64, 131, 257])  # micro-kernel heights, evened-out
# tails; with AMX tiles 16- and 32-row slices, and 257 rows two row blocks of K = 2100 (L2-sized blocks)
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (40, 33), (96, 576), (33, 2100)])  # panel tails, K
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aserve_gemm_equals_linear(aserve_gemm, rows, out_features, in_features, bias, dtype):
    """Partial last panels (40, 33 outputs), odd and split K (2100 > one 2048-step fp32 chunk), biases: what F.linear
    computes, up to the order of the fp32 sums (and in bf16, one rounding of each sum)."""
    from aserve.ops.cpu_gemm import pack_weight, packed_linear

    if dtype == torch.bfloat16 and not torch.ops.aserve.gemm_packs_bf16():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    packed = pack_weight(weight)
    nr, k = (16, in_features) if dtype == torch.float32 else (32, -(-in_features // 2) * 2)
    assert packed.aserve and packed.data.shape == (-(-out_features // nr), k, nr) and packed.data.dtype == dtype
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    got = packed_linear(x, packed, b)
    assert got.dtype == dtype
    # fp32: sums of ~2000 products of size ~1 reach ~50 and lose ~1e-4 to rounding in any order
    tol = dict(atol=5e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -8)
    torch.testing.assert_close(got.double(), expected, **tol)


@pytest.mark.parametrize("rows", [1, 5, 13, 64, 257])
@pytest.mark.parametrize("out_features,in_features", [(40, 33), (96, 576), (33, 2100)])  # panel tails, split K
def test_fp32_weights_of_bf16_values_are_stored_as_bf16_with_the_same_products(aserve_gemm, monkeypatch, rows,
                                                                               out_features, in_features):
    """An fp32 weight whose values are bf16 ones (a bf16 checkpoint run in fp32) is packed as bf16 panels, half the
    bytes, and every output has the fp32 panels' bits: plain, biased, and with the GELU epilogue."""
    from aserve.ops.cpu_gemm import holds_bf16, pack_weight, packed_linear, packed_linear_gelu

    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16().float()
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    assert holds_bf16(weight) and not holds_bf16(weight + 2 ** -20)
    narrow = pack_weight(weight)
    assert narrow.aserve and narrow.data.dtype == torch.bfloat16
    assert narrow.data.shape == (-(-out_features // 16), in_features, 16)
    monkeypatch.setenv("ASERVE_BF16_PANELS", "0")
    assert not holds_bf16(weight)
    wide = pack_weight(weight)
    assert wide.data.dtype == torch.float32 and torch.equal(wide.data, narrow.data.float())
    for b in (None, bias):
        got = packed_linear(x, narrow, b)
        assert got.dtype == torch.float32 and torch.equal(got, packed_linear(x, wide, b))
    assert torch.equal(packed_linear_gelu(x, narrow, bias, "gelu"), packed_linear_gelu(x, wide, bias, "gelu"))
    torch.testing.assert_close(packed_linear(x, narrow, bias).double(),
                               torch.nn.functional.linear(x.double(), weight.double(), bias.double()),
                               atol=5e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="gemm_packed"):  # bf16 rows over them: refused, not misread
        torch.ops.aserve.gemm_packed(x.bfloat16(), narrow.data, None, out_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [100, 600])
def test_aserve_gemm_rows_do_not_depend_on_the_batch(aserve_gemm, dtype, in_features):
    """Each row's output has the same bits whatever rows it is multiplied with: a short last micro-kernel call is
    evened out with the one before it (12 + 4 rows run as 8 + 8), which changes which call a row is in, never the
    order of its sums. One row goes two panels at a time (200 outputs: 7 panels, the last of 8 columns, so some
    thread's share is odd), with the same sums as a panel alone. On AMX tiles, K = 600 goes whole up to 32 rows and
    in chunks beyond: the sums wait in fp32 between chunks, so the same bits again."""
    from aserve.ops.cpu_gemm import pack_weight, packed_linear

    if dtype == torch.bfloat16 and not torch.ops.aserve.gemm_packs_bf16():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(200, in_features, generator=gen).to(dtype)
    bias = torch.randn(200, generator=gen).to(dtype)
    x = torch.randn(70, in_features, generator=gen).to(dtype)
    packed = pack_weight(weight)
    alone = torch.cat([packed_linear(x[i:i + 1], packed, bias) for i in range(70)])
    for rows in [*range(2, 34), 48, 64, 70]:
        assert torch.equal(packed_linear(x[:rows], packed, bias), alone[:rows]), rows


@pytest.mark.parametrize("kind", ["gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 40, 33), (13, 96, 576), (64, 33, 2100), (7, 50, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aserve_gemm_applies_gelu_as_it_writes(aserve_gemm, kind, rows, out_features, in_features, dtype):
    """GELU in the epilogue equals torch's GELU of the fp32 product: after the last of several K chunks only (2100,
    5000 > 2048 in fp32), on panel tails, and in bf16 before the one rounding (so nearer than GELU of the rounded
    product)."""
    from aserve.ops.cpu_gemm import pack_weight, packed_linear, packed_linear_gelu

    if dtype == torch.bfloat16 and not torch.ops.aserve.gemm_packs_bf16():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    packed = pack_weight(weight)
    approximate = "none" if kind == "gelu" else "tanh"
    expected = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), weight.double(), b.double()),
                                        approximate=approximate)
    got = packed_linear_gelu(x, packed, b, kind)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -8)
    torch.testing.assert_close(got.double(), expected, **tol)
    separate = torch.nn.functional.gelu(packed_linear(x, packed, b).double(), approximate=approximate)
    assert (got.double() - expected).abs().max() <= (separate.to(dtype).double() - expected).abs().max() + 1e-6
    with pytest.raises(RuntimeError, match="activation must be 0"):
        torch.ops.aserve.gemm_packed(x, packed.data, b, out_features, 4)


@pytest.mark.parametrize("kind", ["gelu", "gelu_pytorch_tanh"])
def test_aserve_gemm_gelu_over_the_whole_range(aserve_gemm, kind):
    """The epilogue's erf and tanh (rational approximations, clamped) against torch's GELU in float64 over inputs from
    -12 to 12 fed exactly through an identity weight (fp32): the saturated ends, the negative tail, zero."""
    from aserve.ops.cpu_gemm import pack_weight, packed_linear_gelu

    n = 48
    packed = pack_weight(torch.eye(n))
    x = torch.cat([torch.linspace(-12, 12, n * 2001), torch.tensor([0.0, -0.0, 1e-30, -1e-30] * (n // 4))]).reshape(-1, n)
    got = packed_linear_gelu(x, packed, None, kind).double()
    expected = torch.nn.functional.gelu(x.double(), approximate="none" if kind == "gelu" else "tanh")
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() < 2e-6
    big = x.abs() > 6
    assert torch.equal(got[big & (x > 0)], x[big & (x > 0)].double())  # GELU(x) = x in float there
    assert (got[big & (x < 0)].abs() < 1e-6).all()


def bf16_gemm_or_skip():
    if not torch.ops.aserve.gemm_packs_bf16():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")


@pytest.mark.parametrize("rows", [1, 5, 13, 32, 33, 64, 131, 257])  # micro-kernel and AMX slice heights, tails
@pytest.mark.parametrize("inner,in_features", [(16, 33), (48, 576), (32, 2100)])  # one panel, K tails, 2 row blocks
def test_aserve_gemm_applies_silu_and_mul_as_it_writes(aserve_gemm, rows, inner, in_features):
    """A gate | up weight packed by pack_gated_weight: its GEMM with the SiLU-and-mul epilogue equals
    silu(x G^T) * (x U^T) in float64 to bf16 precision, nearer than the separate path (the products rounded to bf16,
    then silu_and_mul); the same pack's plain product is the gate | up product pack_weight gives, bit for bit."""
    from aserve.ops.cpu_gemm import pack_gated_weight, pack_weight, packed_linear, packed_silu_and_mul

    bf16_gemm_or_skip()
    gen = torch.Generator().manual_seed(rows * 7 + inner)
    weight = (torch.randn(2 * inner, in_features, generator=gen) * 2 / in_features ** 0.5).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    gated, plain = pack_gated_weight(weight), pack_weight(weight)
    assert gated is not None and gated.gated and not plain.gated
    product = torch.nn.functional.linear(x.double(), weight.double())
    expected = torch.nn.functional.silu(product[:, :inner]) * product[:, inner:]
    got = packed_silu_and_mul(x, gated)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inner)
    torch.testing.assert_close(got.double(), expected, atol=1e-3, rtol=2 ** -8)
    assert torch.equal(packed_linear(x, gated, None), packed_linear(x, plain, None))
    separate = torch.ops.aserve.silu_and_mul(packed_linear(x, plain, None)).double()
    assert (got.double() - expected).abs().max() <= (separate - expected).abs().max() + 1e-6


def test_aserve_gemm_silu_and_mul_rows_and_range(aserve_gemm):
    """Gates from -1000 to 1000 fed exactly (an identity gate, ups of one): silu to bf16 precision, 0 and the gate
    itself at the ends, nothing inf or NaN; and each row's bits do not depend on the rows beside it."""
    from aserve.ops.cpu_gemm import pack_gated_weight, packed_silu_and_mul

    bf16_gemm_or_skip()
    n = 32
    weight = torch.cat([torch.eye(n), torch.zeros(n, n)]).to(torch.bfloat16)
    weight[n:, -1] = 1  # every up is the row's last input, 1
    gates = torch.cat([torch.linspace(-1000, 1000, 2001), torch.linspace(-12, 12, 4001)])
    gates = torch.cat([gates, torch.zeros(-len(gates) % (n - 1))]).reshape(-1, n - 1)
    x = torch.cat([gates, torch.ones(len(gates), 1)], dim=1).to(torch.bfloat16)
    got = packed_silu_and_mul(x, pack_gated_weight(weight)).double()
    expected = torch.nn.functional.silu(x.double())
    expected[:, -1] = torch.nn.functional.silu(torch.ones(1, dtype=torch.float64))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=2 ** -8)
    alone = torch.cat([packed_silu_and_mul(x[i:i + 1], pack_gated_weight(weight)) for i in range(40)])
    assert torch.equal(packed_silu_and_mul(x[:40], pack_gated_weight(weight)), alone)


@pytest.mark.parametrize("rows", [1, 4, 5, 13, 32, 131, 257])  # split panels (few rows) or claimed parts, row tails
@pytest.mark.parametrize("inner,in_features", [(16, 33), (48, 576), (32, 2100)])  # one pair, K tail, K past one chunk
@pytest.mark.parametrize("stored", ["fp32", "bf16"])  # fp32 panels, or bf16 values stored as bf16 (holds_bf16)
def test_fp32_gemm_applies_silu_and_mul_as_it_writes(aserve_gemm, rows, inner, in_features, stored):
    """fp32: a gate | up weight packed by pack_gated_weight (its panels in pairs, a gate panel and its up panel) gives
    through the SiLU-and-mul epilogue the bits of the separate path (pack_weight's product, then silu_and_mul), with
    the same exp; its plain product is pack_weight's, bit for bit. Past one chunk of K (2048) the product is written
    whole first, then combined. A row alone gets the bits it gets in a batch."""
    from aserve.ops.cpu_gemm import pack_gated_weight, pack_weight, packed_linear, packed_silu_and_mul

    gen = torch.Generator().manual_seed(rows * 7 + inner)
    weight = torch.randn(2 * inner, in_features, generator=gen) * 2 / in_features ** 0.5
    if stored == "bf16":
        weight = weight.to(torch.bfloat16).float()
    x = torch.randn(rows, in_features, generator=gen)
    gated, plain = pack_gated_weight(weight), pack_weight(weight)
    assert gated is not None and gated.gated and gated.data.dtype == plain.data.dtype
    assert plain.data.dtype == (torch.bfloat16 if stored == "bf16" else torch.float32)
    got = packed_silu_and_mul(x, gated)
    assert got.dtype == torch.float32 and got.shape == (rows, inner)
    assert torch.equal(got, torch.ops.aserve.silu_and_mul(packed_linear(x, plain, None)))
    assert torch.equal(got[:3], torch.cat([packed_silu_and_mul(x[i:i + 1], gated) for i in range(min(rows, 3))]))
    assert torch.equal(packed_linear(x, gated, None), packed_linear(x, plain, None))
    product = torch.nn.functional.linear(x.double(), weight.double())
    expected = torch.nn.functional.silu(product[:, :inner]) * product[:, inner:]
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


def test_silu_and_mul_epilogue_is_refused_where_it_cannot_run(aserve_gemm):
    """gate | up halves not a multiple of 16 are packed plainly (pack_gated_weight says None), and the op itself
    refuses SiLU-and-mul over a weight that is not whole pairs of 16-row panels."""
    from aserve.ops.cpu_gemm import SILU_AND_MUL, pack_gated_weight, pack_weight

    assert pack_gated_weight(torch.randn(48, 8)) is None
    assert pack_gated_weight(torch.randn(48, 8, dtype=torch.bfloat16)) is None
    with pytest.raises(RuntimeError, match="whole pairs of 16-row panels"):
        torch.ops.aserve.gemm_packed(torch.randn(2, 8), pack_weight(torch.randn(48, 8)).data, None, 48, SILU_AND_MUL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aserve_gemm_takes_batched_and_strided_rows(aserve_gemm, dtype):
    from aserve.ops.cpu_gemm import pack_weight, packed_linear

    if dtype == torch.bfloat16 and not torch.ops.aserve.gemm_packs_bf16():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")
    weight, x = torch.randn(24, 20).to(dtype), torch.randn(3, 4, 40).to(dtype)
    packed = pack_weight(weight)
    strided = x[..., ::2]  # no unit inner stride: copied
    wide = x[..., :20]  # unit inner stride, rows 40 apart: read in place
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for view in (strided, wide):
        got = packed_linear(view, packed, None)
        assert got.shape == (3, 4, 24)
        torch.testing.assert_close(got, torch.nn.functional.linear(view, weight), atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="weight must be pack_gemm_weight"):
        torch.ops.aserve.gemm_packed(torch.randn(2, 22).to(dtype), packed.data, None, 24)
    with pytest.raises(RuntimeError, match="in the packed weight's dtype"):
        torch.ops.aserve.gemm_packed(torch.randn(2, 20, dtype=torch.float16), packed.data, None, 24)


# FMAs from 2 rows (one row stays on vdpbf16ps), 24 rows a call (25: 13 + 12); 257: row blocks of 120 at K = 2100
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 13, 25, 64, 257])
@pytest.mark.parametrize("out_features,in_features", [(40, 33), (96, 576), (33, 2100)])  # panel and K tails
def test_fma_products_give_the_bits_of_vdpbf16ps(aserve_gemm, bf16_products, rows, out_features, in_features):
    """Off AMX tiles bf16 panels are multiplied by vdpbf16ps or by fp32 FMAs on widened values (Intel's default):
    the same bits, with a bias, the GELU epilogue and SiLU-and-mul, and both what F.linear computes. On a CPU with
    AMX tiles this takes both paths the tiles otherwise keep it from."""
    from aserve.ops.cpu_gemm import pack_gated_weight, pack_weight, packed_linear, packed_linear_gelu, packed_silu_and_mul

    gen = torch.Generator().manual_seed(rows * 100 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    gate_up = (torch.randn(64, in_features, generator=gen) * 2 / in_features ** 0.5).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    packed, gated = pack_weight(weight), pack_gated_weight(gate_up)
    outputs = {}
    for products in ("dpbf16", "fma"):
        assert bf16_products(products) == products
        outputs[products] = (packed_linear(x, packed, bias), packed_linear_gelu(x, packed, bias, "gelu"),
                             packed_silu_and_mul(x, gated))
    for dpbf16, fma in zip(outputs["dpbf16"], outputs["fma"]):
        assert torch.equal(dpbf16, fma)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(outputs["fma"][0].double(), expected, atol=1e-3, rtol=2 ** -8)


@pytest.mark.parametrize("rows", [9, 13, 64])  # past int8_linear's few rows: gemm_int8
def test_int8_gives_the_same_bits_on_fma_products(aserve_gemm, bf16_products, rows):
    """int8 weights on vdpbf16ps (panels widened by each row block's first call) and on FMA products (a tile at a
    time, widened to fp32 in registers, the odd k's product first): the same bits, for a layer with a bias, for an
    odd number of inputs, and for gated tiles' SiLU-and-mul."""
    from aserve.models.layers import Linear
    from aserve.ops.cpu_gemm import SILU_AND_MUL, interleave_gates
    from aserve.quantization import int8

    layer = Linear(600, 164, bias=True).to(torch.bfloat16)
    layer.set_method(int8.Int8LinearMethod(), torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    layer.weight.data.copy_(torch.randn(164, 600, generator=gen))
    layer.bias.data.copy_(torch.randn(164, generator=gen))
    layer.method.process_after_loading(layer)
    x = torch.randn(rows, 600, generator=gen).to(torch.bfloat16)
    q, scale = int8.quantize_per_channel(torch.randn(64, 601, generator=gen), torch.bfloat16)
    odd_x = torch.randn(rows, 601, generator=gen).to(torch.bfloat16)
    gated, gated_scale = int8.tile(interleave_gates(q)), interleave_gates(scale)
    outputs = {}
    with torch.inference_mode():
        for products in ("dpbf16", "fma"):
            bf16_products(products)
            outputs[products] = (layer(x), torch.ops.aserve.gemm_int8(odd_x, int8.tile(q), scale, None, 64),
                                 torch.ops.aserve.gemm_int8(odd_x, gated, gated_scale, None, 64, SILU_AND_MUL))
    for dpbf16, fma in zip(outputs["dpbf16"], outputs["fma"]):
        assert torch.equal(dpbf16, fma)


def test_unknown_bf16_products_are_an_error(aserve_gemm, bf16_products):
    with pytest.raises(RuntimeError, match="expected dpbf16, fma"):
        bf16_products("avx2")


@pytest.mark.parametrize("variable,dtype", [("ASERVE_GEMM", torch.float32), ("ASERVE_BF16_PRODUCTS", torch.bfloat16)])
def test_asking_for_an_unknown_gemm_is_an_error(monkeypatch, variable, dtype):
    from aserve.ops import cpu_gemm

    monkeypatch.setenv(variable, "blas")
    cpu_gemm.gemm_for.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"{variable}='blas'"):
            cpu_gemm.gemm_for(dtype)
    finally:
        cpu_gemm.gemm_for.cache_clear()


def test_an_engine_on_aserve_gemm_is_greedy_equal_to_transformers(aserve_gemm, model_dirs):
    """The fp32 parity guarantee through aserve's GEMM on any CPU (tests/test_parity.py runs whichever GEMM the CPU
    picks by default)."""
    from conftest import load_reference, reference_greedy

    path = model_dirs["llama-gqa-tied"]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", device="cpu")
    model = llm.engine.runner.model
    assert model.packed_head.packed.aserve and model.layers[0].mlp.down_proj.packed.aserve
    prompts = random_prompts(4, lengths=(5, 40), seed=3)
    params = SamplingParams(temperature=0, max_tokens=12)  # stops at eos, as the reference does
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == reference_greedy(load_reference(path), prompts, 12)


def test_an_fp32_engine_on_a_bf16_checkpoint_reads_bf16_panels_and_is_greedy_equal_to_transformers(aserve_gemm,
                                                                                                      tmp_path):
    """What `dtype=auto` runs on a CPU without AVX512-BF16: a bf16 checkpoint in fp32. The weights' panels are stored
    as the checkpoint's bf16 values, and the greedy tokens are transformers' fp32 ones on the same checkpoint."""
    from conftest import build_tiny_model, load_reference, reference_greedy

    path = build_tiny_model(tmp_path / "llama", "llama-gqa-tied")
    load_reference(path).to(torch.bfloat16).save_pretrained(path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", device="cpu")
    model = llm.engine.runner.model
    for linear in (model.packed_head, model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj):
        assert linear.packed.aserve and linear.packed.data.dtype == torch.bfloat16
    prompts = random_prompts(4, lengths=(5, 40), seed=5)
    params = SamplingParams(temperature=0, max_tokens=12)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == reference_greedy(load_reference(path), prompts, 12)


@pytest.mark.parametrize("asked,amx,expected", [("", True, "aserve"), ("onednn", True, "onednn"),
                                                ("", False, "aserve"), ("onednn", False, "onednn")])
def test_aserve_gemm_is_the_default_with_or_without_amx(monkeypatch, asked, amx, expected):
    """aserve's bf16 GEMM multiplies on AMX tiles where the CPU has them (faster than oneDNN's at decode batches on a
    Sapphire Rapids class Xeon), so it is the default wherever it is built, unless ASERVE_GEMM says otherwise; a
    model whose steps are all large (the pooling runner) takes oneDNN's bf16 GEMM on AMX CPUs, packed so inside
    cpu_gemm.packing(large_steps=True)."""
    from dataclasses import replace

    from aserve import hardware
    from aserve.ops import cpu_gemm, cpu_kernels

    if not (cpu_kernels.available() and hasattr(torch.ops.aserve, "gemm_packed")
            and torch.ops.aserve.gemm_packs_bf16()):
        pytest.skip("aserve's bf16 GEMM is not built here (needs AVX512-BF16)")
    monkeypatch.setattr(hardware, "cpu_info", lambda: replace(hardware.CpuInfo("AVX512", True, False, 2), amx_bf16=amx))
    monkeypatch.setenv("ASERVE_GEMM", asked)
    cpu_gemm.gemm_for.cache_clear()
    try:
        assert cpu_gemm.gemm_for(torch.bfloat16) == expected
        assert cpu_gemm.gemm_for(torch.float32) == expected
        large = "onednn" if amx else expected
        assert cpu_gemm.gemm_for(torch.bfloat16, large_steps=True) == large
        assert cpu_gemm.gemm_for(torch.float32, large_steps=True) == expected
        weight = torch.randn(40, 24, dtype=torch.bfloat16)
        with cpu_gemm.packing(large_steps=True):
            assert cpu_gemm.pack_weight(weight).aserve == (large == "aserve")
        assert cpu_gemm.pack_weight(weight).aserve == (expected == "aserve")
    finally:
        cpu_gemm.gemm_for.cache_clear()
