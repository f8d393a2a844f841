"""The Triton backend against the torch backend: compiled on a CUDA GPU when there is one, else on the CPU
through Triton's interpreter. The torch backend, on the CPU, is the reference either way."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before triton defines any kernel: they are interpreted from then on
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
DEVICE = "cuda" if CUDA else "cpu"  # where the Triton kernels run
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

from aserve import LLM, SamplingParams  # noqa: E402
from aserve.attention import select_backend  # noqa: E402
from aserve.attention.kv_quant import FP8_FORMATS, quantize  # noqa: E402
from aserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from aserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from aserve.ops.attention import pair_keys, unpair_keys  # noqa: E402
from conftest import make_layout, random_prompts  # noqa: E402

# (tokens in the cache, tokens this step) per request, decode requests first as the runner orders them:
# decodes at the first position, inside and past a block; prefill chunks alone and after cached context.
MIXED = [(0, 1), (3, 1), (40, 1), (0, 9), (21, 6), (5, 19)]


def compare(requests, block_size=16, heads=(4, 2), head_dim=16, window=None, softcap=None,
            dtype=torch.float32, atol=1e-5, fp8=None, causal=True):
    """The Triton backend on DEVICE in `dtype` against the torch backend on the CPU in float32, both from the
    same `dtype`-rounded inputs: the cache each writes must be equal, their outputs within `atol`. With `fp8`
    (a format name) both write and read an FP8 cache of bytes. `causal` False: an encoder's layer, whose keys the
    torch backend does not keep (the Triton one reads them back from the cache), so only outputs compare."""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads = heads
    layout = make_layout(requests, block_size, gen)
    layer = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            scale=head_dim ** -0.5, sliding_window=window, logit_softcap=softcap,
                            k_scale=0.02, v_scale=0.02, kv_scales_pending=False, causal=causal)
    tokens = len(layout.positions)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    key, value = (torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    shape = TorchAttentionBackend().kv_cache_shape(1, layout.num_physical_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)  # stale values everywhere: only masks keep them out
    fmt = FP8_FORMATS[fp8] if fp8 else None
    if fmt:  # stale bytes that are real FP8 values (the engine's cache starts zeroed, never NaN)
        cache = quantize(cache, 0.02, fmt)
    outs, caches = [], []
    for backend, device, kind in ((TorchAttentionBackend(), "cpu", torch.float32),
                                  (TritonAttentionBackend(), DEVICE, dtype)):
        backend.kv_format = fmt
        q, k, v = (t.to(device, kind, copy=True) for t in (query, key, value))
        kv = cache.to(device, cache.dtype if fmt else kind, copy=True)
        paired = isinstance(backend, TorchAttentionBackend)  # its keys in pairs of dims (ops.attention), as rows after
        if paired:
            kv[0, 0] = pair_keys(kv[0, 0])
        meta = backend.build_metadata(layout, num_kv_heads)
        out = backend.forward(layer, q, k, v, (kv[0, 0], kv[0, 1]), meta)
        assert out.dtype == kind and out.device.type == device
        if paired:
            kv[0, 0] = unpair_keys(kv[0, 0])
        outs.append(out.cpu().float())
        caches.append(kv.cpu().float())
    if causal:
        assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 16), ((6, 2), 16), ((2, 2), 24)],
                         ids=["gqa", "gqa-group3", "mha-dim24"])
def test_mixed_batch_matches_torch(block_size, heads, head_dim):
    compare(MIXED, block_size, heads, head_dim)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (7, 1.0)], ids=["window", "softcap", "both"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_window_and_softcap_match_torch(block_size, window, softcap):
    compare(MIXED, block_size, window=window, softcap=softcap)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fp8_cache_matches_torch(fmt, dtype, atol):
    compare(MIXED, 16, (6, 2), 16, dtype=dtype, atol=atol, fp8=fmt)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_bidirectional_matches_torch(heads):
    """An encoder's layer: whole prompts, one-token ones among them, each token seeing all of its prompt."""
    compare([(0, 1), (0, 1), (0, 9), (0, 23), (0, 40)], heads=heads, causal=False)


def test_decode_only_and_single_prefill():
    compare([(2, 1), (33, 1), (64, 1)])
    compare([(0, 37)], block_size=32, heads=(2, 2))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype,atol", [(torch.float16, 5e-3),
                                        pytest.param(torch.bfloat16, 3e-2, marks=needs_cuda)],
                         ids=["float16", "bfloat16"])
def test_half_precision_matches_torch(dtype, atol, block_size):
    """bfloat16 only on a GPU: the interpreter's tl.dot gets it wrong (raw bits)."""
    compare(MIXED, block_size, dtype=dtype, window=9, atol=atol)
    compare(MIXED, block_size, heads=(8, 2), head_dim=64, softcap=2.0, dtype=dtype, atol=atol)


@needs_cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 5e-3), (torch.bfloat16, 3e-2)],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_realistic_shapes_on_the_gpu(dtype, atol, block_size):
    """Head sizes of real models (64, 128 and the embedded model's 48), wide GQA groups, long cached contexts
    that span many key steps, and many tiles per request: too slow for the interpreter."""
    long_mixed = [(0, 1), (17, 1), (300, 1), (1000, 1), (0, 200), (129, 64), (511, 33), (2000, 5)]
    compare(long_mixed, block_size, heads=(32, 8), head_dim=128, dtype=dtype, atol=atol)
    compare(long_mixed, block_size, heads=(6, 2), head_dim=48, dtype=dtype, atol=atol)
    compare(long_mixed, block_size, heads=(16, 1), head_dim=64, window=100, softcap=30.0, dtype=dtype, atol=atol)
    compare(long_mixed, block_size, heads=(8, 8), head_dim=64, window=4096, dtype=dtype, atol=atol)


def test_select_backend(monkeypatch):
    cpu = torch.device("cpu")
    assert select_backend(None, cpu).name == "torch"
    if CUDA:
        assert select_backend(None, torch.device("cuda")).name == "triton"
    with pytest.raises(ValueError, match="'torch' runs on the CPU only"):
        select_backend("torch", torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", cpu).name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", cpu)


@pytest.mark.parametrize("family", ["llama-gqa-tied", "gemma2"])
def test_greedy_output_matches_torch_backend(model_dirs, family):
    """Prompts longer than a chunk of batched tokens, so prefill also runs against cached context; gemma2
    adds its sliding window (16) and soft-capping. The torch backend runs on the CPU, the Triton one on DEVICE."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, lengths=(5, 40), seed=3)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    tokens, logprobs = {}, {}
    for backend, device in (("torch", "cpu"), ("triton", DEVICE)):
        llm = LLM(str(model_dirs[family]), dtype="float32", kv_cache_memory="4MiB", block_size=8,
                  max_num_batched_tokens=32, attention_backend=backend, device=device)
        assert llm.engine.executor.info.attention_backend == backend
        assert llm.engine.runner.device.type == device
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        tokens[backend] = [o.token_ids for o in outs]
        logprobs[backend] = [o.cumulative_logprob for o in outs]
    assert tokens["triton"] == tokens["torch"]
    assert logprobs["triton"] == pytest.approx(logprobs["torch"], abs=1e-4)  # greedy tokens alone can hide drift


def test_encoder_embeddings_match_torch_backend(tmp_path):
    """A BERT embedder end to end: the Triton backend's bidirectional attention gives the torch backend's vectors."""
    from pooling_util import TEXTS, encoder_folder

    path = encoder_folder(tmp_path / "bert")
    vectors = {}
    for backend, device in (("torch", "cpu"), ("triton", DEVICE)):
        llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB", attention_backend=backend, device=device)
        vectors[backend] = torch.stack([o.outputs.data for o in llm.encode(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(vectors["triton"], vectors["torch"], atol=1e-4, rtol=1e-4)


# -- the whole engine on a GPU against the CPU: batches, block sizes, chunks, preemption and swaps ------------

GPU_PROMPTS = random_prompts(12, lengths=(1, 120), seed=5)
CASES = {  # name -> engine options; kv_cache_memory is in blocks of the model's K/V (fp32)
    "batch": dict(),
    "block32": dict(block_size=32),
    "chunked": dict(max_num_batched_tokens=24, max_num_seqs=5),
    "preempt": dict(kv_blocks=12),
    "swap": dict(kv_blocks=12, policy="fcfs-swap", swap_blocks=64),
    "swap-chunked": dict(kv_blocks=12, policy="fcfs-swap", swap_blocks=64, max_num_batched_tokens=40),
}


def engine_run(path, device, backend, case):
    from conftest import kv_memory_for_blocks, watch_swaps

    options = dict(CASES[case])
    block_size = options.get("block_size", 16)
    kv_blocks = options.pop("kv_blocks", 256)
    swap_blocks = options.pop("swap_blocks", 0)
    llm = LLM(str(path), dtype="float32", device=device, attention_backend=backend,
              kv_cache_memory=kv_memory_for_blocks(path, kv_blocks, block_size),
              swap_space=str(kv_memory_for_blocks(path, swap_blocks, block_size) or "0"), **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in GPU_PROMPTS],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert llm.engine.runner.device.type == device and llm.engine.executor.info.attention_backend == backend
    stats = llm.engine.scheduler.stats()
    llm.engine.check_idle()
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs], stats)


@pytest.fixture(scope="module")
def cpu_reference(model_dirs):
    """The torch backend on the CPU, per (family, case), computed the first time a test asks."""
    from aserve.config import DEFAULT_MODEL_DIR

    dirs, cache = {**model_dirs, "default": DEFAULT_MODEL_DIR}, {}

    def get(family, case):
        if (family, case) not in cache:
            cache[family, case] = engine_run(dirs[family], "cpu", "torch", case)
        return cache[family, case]
    return get


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["default", "llama-gqa-tied", "gemma2", "mistral-swa"])
def test_gpu_engine_matches_the_cpu(model_dirs, cpu_reference, family, case):
    from aserve.config import DEFAULT_MODEL_DIR

    dirs = {**model_dirs, "default": DEFAULT_MODEL_DIR}
    tokens, logprobs, stats = engine_run(dirs[family], "cuda", "triton", case)
    ref_tokens, ref_logprobs, _ = cpu_reference(family, case)
    if "kv_blocks" in CASES[case]:
        assert sum(stats.preemptions.values()) > 0
    if "swap_blocks" in CASES[case]:
        assert stats.preemptions["swap"] > 0 and stats.blocks_swapped_in == stats.blocks_swapped_out > 0
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-3)


@needs_cuda
def test_gpu_swap_restores_the_same_bytes(model_dirs):
    """Blocks swapped out to pinned host memory and back hold exactly what the GPU held."""
    from conftest import kv_memory_for_blocks, watch_swaps

    path = model_dirs["llama-gqa-tied"]
    llm = LLM(str(path), dtype="float32", device="cuda", policy="fcfs-swap",
              kv_cache_memory=kv_memory_for_blocks(path, 8), swap_space=str(kv_memory_for_blocks(path, 40)))
    runner = llm.engine.runner
    assert runner.kv_cache.is_cuda and runner.host_cache.is_pinned()
    checked = watch_swaps(runner, nonzero=True)  # real K/V, not zeros
    llm.generate([{"prompt_token_ids": p} for p in GPU_PROMPTS[:8]],
                 SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert checked
    llm.engine.check_idle()
