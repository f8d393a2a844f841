"""The Triton backend against the torch backend, on the CPU through Triton's interpreter."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton defines any kernel: they are interpreted from then on
pytest.importorskip("triton")

from aserve import LLM, SamplingParams  # noqa: E402
from aserve.attention import BatchLayout, select_backend  # noqa: E402
from aserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from aserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from conftest import random_prompts  # noqa: E402

# (tokens in the cache, tokens this step) per request, decode requests first as the runner orders them:
# decodes at the first position, inside and past a block; prefill chunks alone and after cached context.
MIXED = [(0, 1), (3, 1), (40, 1), (0, 9), (21, 6), (5, 19)]


def make_layout(requests, block_size: int, gen: torch.Generator) -> BatchLayout:
    """The runner's layout (model_runner._prepare) over a random permutation of physical blocks; the last
    block is the null block that pads the tables."""
    need = [-(-(start + n) // block_size) for start, n in requests]
    null = sum(need)
    physical = torch.randperm(null, generator=gen)
    tables = torch.full((len(requests), max(need)), null, dtype=torch.long)
    used = 0
    for i, k in enumerate(need):
        tables[i, :k] = physical[used:used + k]
        used += k
    starts, counts = [s for s, _ in requests], [n for _, n in requests]
    positions = torch.cat([torch.arange(s, s + n) for s, n in requests])
    row = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor(counts))
    slots = tables[row, positions // block_size] * block_size + positions % block_size
    num_decode = sum(1 for n in counts if n == 1)
    return BatchLayout(positions, slots, tables, starts, counts, num_decode, block_size, null + 1)


def compare(requests, block_size=16, heads=(4, 2), head_dim=16, window=None, softcap=None,
            dtype=torch.float32, atol=1e-5):
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads = heads
    layout = make_layout(requests, block_size, gen)
    layer = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            scale=head_dim ** -0.5, sliding_window=window, logit_softcap=softcap)
    tokens = len(layout.positions)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    key, value = (torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    shape = TorchAttentionBackend().kv_cache_shape(1, layout.num_physical_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)  # stale values everywhere: only masks keep them out
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        kv = cache.clone()
        meta = backend.build_metadata(layout, num_kv_heads)
        outs.append(backend.forward(layer, query, key, value, (kv[0, 0], kv[0, 1]), meta))
        caches.append(kv)
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 16), ((6, 2), 16), ((2, 2), 24)],
                         ids=["gqa", "gqa-group3", "mha-dim24"])
def test_mixed_batch_matches_torch(block_size, heads, head_dim):
    compare(MIXED, block_size, heads, head_dim)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (7, 1.0)], ids=["window", "softcap", "both"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_window_and_softcap_match_torch(block_size, window, softcap):
    compare(MIXED, block_size, window=window, softcap=softcap)


def test_decode_only_and_single_prefill():
    compare([(2, 1), (33, 1), (64, 1)])
    compare([(0, 37)], block_size=32, heads=(2, 2))


def test_half_precision_matches_torch():
    """float16: the interpreter's tl.dot gets bfloat16 wrong (raw bits), so bfloat16 is left to a GPU."""
    compare(MIXED, dtype=torch.float16, window=9, atol=5e-3)


def test_select_backend(monkeypatch):
    cpu = torch.device("cpu")
    assert select_backend(None, cpu).name == "torch"
    assert select_backend("triton", cpu).name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", cpu)


@pytest.mark.parametrize("family", ["llama-gqa-tied", "gemma2"])
def test_greedy_output_matches_torch_backend(model_dirs, family):
    """Prompts longer than a chunk of batched tokens, so prefill also runs against cached context; gemma2
    adds its sliding window (16) and soft-capping."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, lengths=(5, 40), seed=3)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    tokens, logprobs = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dirs[family]), dtype="float32", kv_cache_memory="4MiB", block_size=8,
                  max_num_batched_tokens=32, attention_backend=backend)
        assert llm.engine.executor.info.attention_backend == backend
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        tokens[backend] = [o.token_ids for o in outs]
        logprobs[backend] = [o.cumulative_logprob for o in outs]
    assert tokens["triton"] == tokens["torch"]
    assert logprobs["triton"] == pytest.approx(logprobs["torch"], abs=1e-4)  # greedy tokens alone can hide drift
