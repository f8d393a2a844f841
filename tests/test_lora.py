"""Multi-LoRA serving: adapters batched beside the base weights equal transformers + peft, token for token (fp32)."""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from aserve import LLM, LoRARequest, SamplingParams
import conftest
from conftest import kv_memory_for_blocks, random_prompts
from lora_helpers import greedy, last_logits, load_with_adapter, make_adapter

# peft imports triton: only when a test runs, so that TRITON_INTERPRET (set by test_triton_backend at collection)
# is in place first
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed (the test extra "
                                                                                  "has it)")

FAMILY = "llama-gqa-tied"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    """Two adapters of different ranks and targets, an rsLoRA one, one with rank and alpha patterns."""
    base = model_dirs[FAMILY]
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": make_adapter(base, root / "attn", targets=["q_proj", "v_proj", "o_proj"], r=4, alpha=8, seed=1),
        "all": make_adapter(base, root / "all", r=8, alpha=16, seed=2,
                            targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        "rslora": make_adapter(base, root / "rslora", targets=["gate_proj", "up_proj", "down_proj"], r=16, alpha=8,
                               seed=3, use_rslora=True),
        "patterns": make_adapter(base, root / "patterns", targets=r".*\.(q_proj|down_proj)", r=4, alpha=4, seed=4,
                                 rank_pattern={"down_proj": 12}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 32},
                                 safetensors=False),
    }


def lora_llm(model_dirs, **kwargs) -> LLM:
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory="16MiB", device="cpu",
                   dtype="float32")
    return LLM(str(model_dirs[FAMILY]), **{**options, **kwargs})


def request_of(adapters, name: str | None, int_id: int | None = None):
    if name is None:
        return None
    return LoRARequest(name, int_id or list(adapters).index(name) + 1, str(adapters[name]))


def test_base_and_two_adapters_in_one_batch_equal_peft(model_dirs, adapters):
    """Base, `attn` (r=4, attention only) and `all` (r=8, every projection) interleaved in one batch: each equals
    transformers + peft with its adapter, token for token, and the adapters really change the output."""
    base = model_dirs[FAMILY]
    prompts = random_prompts(6, lengths=(5, 40), seed=11)
    names = [None, "attn", "all", "attn", None, "all"]
    llm = lora_llm(model_dirs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[request_of(adapters, n) for n in names])
    references = {name: load_with_adapter(base, adapters[name] if name else None) for name in set(names)}
    got = [o.outputs[0].token_ids for o in outs]
    expected = [greedy(references[n], p, GREEDY.max_tokens) for n, p in zip(names, prompts)]
    assert got == expected
    base_only = [greedy(references[None], p, GREEDY.max_tokens) for p in prompts]
    assert all(g != b for g, b, n in zip(got, base_only, names) if n is not None)  # the adapters did something
    llm.engine.check_idle()


@pytest.mark.parametrize("name", ["all", "rslora", "patterns"])
def test_logits_within_1e4_of_peft(model_dirs, adapters, name):
    """The last prompt position's logits: rsLoRA's alpha/sqrt(r), rank_pattern / alpha_pattern per module, a .bin
    adapter and a regex target_modules all read as peft reads them."""
    base = model_dirs[FAMILY]
    prompt = random_prompts(1, lengths=(20, 21), seed=5)[0]
    llm = lora_llm(model_dirs)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=20),
                       use_tqdm=False, lora_request=request_of(adapters, name))[0]
    expected = last_logits(load_with_adapter(base, adapters[name]), prompt).log_softmax(-1)
    got = out.outputs[0].logprobs[0]
    for token, logprob in got.items():
        assert abs(logprob.logprob - expected[token].item()) < 1e-4
    assert out.outputs[0].token_ids[0] == int(expected.argmax())


def test_one_slot_serves_two_adapters_in_turn(model_dirs, adapters):
    """max_loras=1: the scheduler never puts two adapters in one step, so requests of `attn` and `all` take turns
    (base requests run beside either), and every output still equals peft's."""
    base = model_dirs[FAMILY]
    prompts = random_prompts(5, lengths=(5, 30), seed=12)
    names = ["attn", "all", None, "all", "attn"]
    llm = lora_llm(model_dirs, max_loras=1, max_cpu_loras=2)
    steps = []
    original = llm.engine.scheduler.schedule

    def watched(*args):
        out = original(*args)
        steps.append({r.lora.identity for r, _ in llm.engine.scheduler.scheduled if r.lora is not None})
        return out

    llm.engine.scheduler.schedule = watched
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[request_of(adapters, n) for n in names])
    assert max(len(s) for s in steps) == 1 and len(set().union(*steps)) == 2
    assert llm.engine.policy.max_loras == 1  # the constraint, where a policy plugin can read it
    references = {name: load_with_adapter(base, adapters[name] if name else None) for name in set(names)}
    assert [o.outputs[0].token_ids for o in outs] == [greedy(references[n], p, GREEDY.max_tokens)
                                                      for n, p in zip(names, prompts)]
    slots = llm.engine.runner.lora
    assert slots.disk_loads == 2  # each read from disk once, then from the host cache
    assert not slots.in_use and len(slots.slot_of) == 1  # no slot pinned after the steps; one slot, one adapter
    llm.engine.check_idle()


def test_prefix_cache_is_keyed_by_the_adapters_content(model_dirs, adapters, tmp_path):
    """The same prompt under two adapters shares no block; under one adapter it hits (under any name: the key is
    the adapter's content). An adapter rewritten under the same name and path is a new adapter: no block computed
    with the old weights serves it."""
    base = model_dirs[FAMILY]
    prompt = {"prompt_token_ids": random_prompts(1, lengths=(50, 51), seed=13)[0]}
    path = tmp_path / "sql"
    shutil.copytree(adapters["attn"], path)
    sql = LoRARequest("sql", 1, str(path))
    llm = lora_llm(model_dirs, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(lora):
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]

    first = run(sql)
    assert first.num_cached_tokens == 0
    assert run(sql).num_cached_tokens == 48  # three whole blocks hit
    assert run(request_of(adapters, "all")).num_cached_tokens == 0
    assert run(None).num_cached_tokens == 0
    assert run(LoRARequest("copy", 9, str(adapters["attn"]))).num_cached_tokens == 48  # same content, same blocks
    shutil.rmtree(path)
    shutil.copytree(adapters["rslora"], path)  # the same name and path, new weights
    again = run(sql)
    assert again.num_cached_tokens == 0
    expected = greedy(load_with_adapter(base, adapters["rslora"]), prompt["prompt_token_ids"], 4)
    assert again.outputs[0].token_ids == expected != first.outputs[0].token_ids
    llm.engine.check_idle()


def test_preempted_adapter_requests_recompute_under_their_adapter(model_dirs, adapters):
    """A KV cache too small for everyone: requests are preempted and recomputed, each still under its adapter."""
    base = model_dirs[FAMILY]
    prompts = random_prompts(6, lengths=(20, 40), seed=14)
    names = ["all", "attn", "all", None, "attn", "all"]
    llm = lora_llm(model_dirs, kv_cache_memory=kv_memory_for_blocks(base, 12), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[request_of(adapters, n) for n in names])
    assert llm.engine.scheduler.num_preemptions > 0
    references = {name: load_with_adapter(base, adapters[name] if name else None) for name in set(names)}
    assert [o.outputs[0].token_ids for o in outs] == [greedy(references[n], p, 24) for n, p in zip(names, prompts)]
    llm.engine.check_idle()


def rewrite_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("case,match", [
    ("rank", "rank 16 is above max_lora_rank=8"),
    ("dora", "DoRA"),
    ("modules_to_save", "modules_to_save"),
    ("bias", "bias='all'"),
    ("target", "target module 'fc9' matches nothing"),
    ("base", "an adapter for another base model"),
    ("missing", "no adapter_config.json"),
])
def test_adapters_aserve_cannot_serve_are_refused_in_one_line(model_dirs, adapters, tmp_path, case, match):
    base = model_dirs[FAMILY]
    folder = {
        "rank": lambda: adapters["rslora"],
        "dora": lambda: rewrite_config(adapters["attn"], tmp_path / "a", use_dora=True),
        "modules_to_save": lambda: rewrite_config(adapters["attn"], tmp_path / "a", modules_to_save=["lm_head"]),
        "bias": lambda: rewrite_config(adapters["attn"], tmp_path / "a", bias="all"),
        "target": lambda: rewrite_config(adapters["attn"], tmp_path / "a", target_modules=["q_proj", "fc9"]),
        "base": lambda: make_adapter(conftest.build_tiny_model(tmp_path / "other", FAMILY, hidden_size=32),
                                     tmp_path / "a", targets=["q_proj"]),
        "missing": lambda: tmp_path,
    }[case]()
    llm = lora_llm(model_dirs, max_lora_rank=8)
    with pytest.raises(ValueError, match=match) as info:
        llm.generate(["hello"], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(folder)))
    assert "\n" not in str(info.value)
    assert llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # the engine still serves
    llm.engine.check_idle()


def test_lora_requests_must_fit_the_prompts_and_the_engine(model_dirs, adapters):
    llm = lora_llm(model_dirs)
    with pytest.raises(ValueError, match="2 prompts but 3 lora requests"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[None] * 3)
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, "/nowhere")
    plain = LLM(str(model_dirs[FAMILY]), kv_cache_memory="16MiB", device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="without enable_lora"):
        plain.generate(["a"], GREEDY, use_tqdm=False, lora_request=request_of(adapters, "attn"))
    llm.engine.check_idle()
    plain.engine.check_idle()


def test_async_llm_takes_lora_requests(model_dirs, adapters):
    import asyncio

    from aserve import AsyncLLM

    base = model_dirs[FAMILY]
    prompt = random_prompts(1, lengths=(10, 11), seed=15)[0]

    async def main():
        async with AsyncLLM(str(base), enable_lora=True, max_lora_rank=16, kv_cache_memory="16MiB", device="cpu",
                            dtype="float32") as engine:
            final = await engine.infer({"prompt_token_ids": prompt}, GREEDY, lora_request=request_of(adapters, "all"))
            streamed = []
            async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY,
                                             lora_request=request_of(adapters, "attn")):
                streamed.extend(out.outputs[0].token_ids)
            return final.outputs[0].token_ids, streamed

    via_all, via_attn = asyncio.run(main())
    assert via_all == greedy(load_with_adapter(base, adapters["all"]), prompt, GREEDY.max_tokens)
    assert via_attn == greedy(load_with_adapter(base, adapters["attn"]), prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["kernel", "packed", "plain"])
def test_every_path_adds_each_tokens_own_adapter(monkeypatch, dtype, path):
    """aserve's kernel, the packed oneDNN GEMMs with the mask and the plain torch ops give, per token, the delta of
    its own slot's adapter (a fused layer of three slices with different widths, ranks below the slot width, tokens
    of the base model untouched): what a per-token reference loop computes in float64."""
    from aserve.lora import layers as lora_layers
    from aserve.ops import cpu_gemm

    if path == "kernel" and not lora_layers.kernel_available(torch.device("cpu")):
        pytest.skip("aserve's CPU kernels are not built here")
    if path == "packed" and not cpu_gemm.can_pack(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    monkeypatch.setattr(lora_layers, "kernel_available", lambda device: path == "kernel")
    monkeypatch.setenv("ASERVE_PREPACK", "0" if path == "plain" else "1")
    gen = torch.Generator().manual_seed(3)
    sizes, in_features, slots, max_rank = [40, 24, 24], 48, 3, 16
    step = lora_layers.LoRAStep(slots, max_rank, dtype, torch.device("cpu"))
    layer = lora_layers.LoRALinear(step, 0, ("q_proj", "k_proj", "v_proj"), in_features, sizes, dtype,
                                   torch.device("cpu"))
    weights = {}
    for slot, rank in ((0, 4), (2, 16)):  # slot 1 stays empty
        for module, size in zip(("q_proj", "k_proj", "v_proj"), sizes):
            a_t = torch.randn(in_features, rank, generator=gen).to(dtype)
            b_t = torch.randn(rank, size, generator=gen).to(dtype)
            weights[slot, module] = (a_t, b_t)
            layer.write(slot, module, a_t, b_t)
    layer.repack()
    counts, request_slots = [1, 1, 5, 3, 1], [2, None, 0, 2, 1]
    step.set(request_slots, counts)
    x = torch.randn(sum(counts), in_features, generator=gen).to(dtype)
    y = torch.randn(sum(counts), sum(sizes), generator=gen).to(dtype)
    expected = y.double().clone()
    token_slots = [s for s, n in zip(request_slots, counts) for _ in range(n)]
    for t, slot in enumerate(token_slots):
        offset = 0
        for module, size in zip(("q_proj", "k_proj", "v_proj"), sizes):
            if (slot, module) in weights:
                a_t, b_t = weights[slot, module]
                expected[t, offset:offset + size] += (x[t].double() @ a_t.double()) @ b_t.double()
            offset += size
    got = layer(x, y.clone())
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.5, rtol=2e-2)
    torch.testing.assert_close(got.double(), expected, **tol)
    base_rows = [t for t, s in enumerate(token_slots) if s in (None, 1)]
    assert torch.equal(got[base_rows], y[base_rows])


def test_tensor_parallel_ranks_shard_the_adapters_as_the_base(model_dirs, adapters):
    """TP=2 (q|k|v and gate|up split by outputs, o and down by inputs: A or B sharded to match) gives TP=1's tokens
    and logprobs, with base and adapter requests mixed."""
    prompts = random_prompts(4, lengths=(5, 30), seed=16)
    names = ["all", None, "attn", "patterns"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)

    def run(**options):
        llm = lora_llm(model_dirs, max_loras=3, **options)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=[request_of(adapters, n) for n in names])
        llm.engine.check_idle()
        if options:
            llm.engine.executor.shutdown()
        return outs

    one, two = run(), run(tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    for a, b in zip(one, two):
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-4)


def test_data_parallel_replicas_each_serve_every_adapter(model_dirs, adapters):
    """Two replicas: requests of two adapters spread over both, each replica loading what it is asked for."""
    import asyncio

    from aserve import AsyncLLM

    base = model_dirs[FAMILY]
    prompts = random_prompts(6, lengths=(5, 20), seed=17)
    names = ["attn", "all", "attn", "all", None, "all"]

    async def main():
        async with AsyncLLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, data_parallel_size=2,
                            kv_cache_memory="16MiB", device="cpu", dtype="float32") as engine:
            outs = await asyncio.gather(*(engine.infer({"prompt_token_ids": p}, GREEDY,
                                                       lora_request=request_of(adapters, n))
                                          for p, n in zip(prompts, names)))
            return [o.outputs[0].token_ids for o in outs]

    got = asyncio.run(main())
    references = {name: load_with_adapter(base, adapters[name] if name else None) for name in set(names)}
    assert got == [greedy(references[n], p, GREEDY.max_tokens) for n, p in zip(names, prompts)]
