"""The features built on the CPU, run on a CUDA GPU (Triton attention, CUDA tensors end to end) against the same
engine on the CPU: LoRA adapters, beam search, n-gram speculation, int8 weights, an FP8 KV cache, structured
output and encoder embeddings. Skipped without a GPU; the CPU suite tests each feature against its reference."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from aserve import LLM, BeamSearchParams, LoRARequest, SamplingParams
from conftest import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FAMILY = "llama-gqa-tied"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(6, lengths=(5, 40), seed=5)]
OPTIONS = dict(dtype="float32", kv_cache_memory="16MiB")


def both(path, **options) -> dict[str, LLM]:
    """The same engine on the CPU (torch attention) and on the GPU (Triton attention)."""
    return {device: LLM(str(path), device=device, **{**OPTIONS, **options}) for device in ("cpu", "cuda")}


def greedy_runs(engines, prompts=PROMPTS, params=GREEDY, **kwargs):
    runs = {}
    for device, llm in engines.items():
        outs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
        runs[device] = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs])
        llm.engine.check_idle()
    return runs


def assert_same_greedy(runs, abs_logprob=1e-3):
    assert runs["cuda"][0] == runs["cpu"][0]
    assert runs["cuda"][1] == pytest.approx(runs["cpu"][1], abs=abs_logprob)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed")
def test_lora_adapters_on_the_gpu(model_dirs, tmp_path):
    from lora_helpers import make_adapter

    base = model_dirs[FAMILY]
    adapter = make_adapter(base, tmp_path / "all", r=8, alpha=16, seed=2,
                           targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    engines = both(base, enable_lora=True, max_loras=2, max_lora_rank=16)
    requests = [None, LoRARequest("all", 1, str(adapter))] * 3
    runs = greedy_runs(engines, lora_request=requests)
    assert_same_greedy(runs)
    assert runs["cuda"][0][0] != runs["cuda"][0][1] or runs["cuda"][0][2] != runs["cuda"][0][3]


def test_beam_search_on_the_gpu(model_dirs):
    engines = both(model_dirs[FAMILY])
    params = BeamSearchParams(3, 10, ignore_eos=True)
    cpu, gpu = (engines[d].beam_search(PROMPTS[:3], params) for d in ("cpu", "cuda"))
    for a, b in zip(cpu, gpu):
        assert [s.tokens for s in b.sequences] == [s.tokens for s in a.sequences]
        assert [s.score for s in b.sequences] == pytest.approx([s.score for s in a.sequences], abs=1e-3)


def test_ngram_speculation_on_the_gpu(model_dirs):
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    looping = [{"prompt_token_ids": p * 4} for p in random_prompts(4, lengths=(3, 8), seed=9)]
    plain = greedy_runs(both(model_dirs[FAMILY]), prompts=looping)
    spec = greedy_runs(both(model_dirs[FAMILY], speculative_config=ngram), prompts=looping)
    assert_same_greedy(spec)
    assert spec["cuda"][0] == plain["cpu"][0]


@pytest.mark.parametrize("family", ["llama-untied", "llama-gqa-tied"])
def test_int8_weights_on_the_gpu(model_dirs, family):
    """int8 on CUDA runs the Triton kernel; the CPU its own: the same rounding of the same int8 weights."""
    assert_same_greedy(greedy_runs(both(model_dirs[family], quantization="int8")), abs_logprob=2e-3)


def test_fp8_kv_cache_on_the_gpu(model_dirs):
    assert_same_greedy(greedy_runs(both(model_dirs[FAMILY], kv_cache_dtype="fp8", enable_prefix_caching=False)),
                       abs_logprob=2e-3)


def test_structured_output_on_the_gpu():
    """The grammar's token bitmask applied to logits on the GPU: every sample matches, and stops."""
    import re

    from aserve.structured_output import StructuredOutputsParams

    regex, choices = r"[A-Z][a-z]{2,6}-[0-9]{3}", ["yes", "no", 'say "maybe"']
    llm = LLM(device="cuda", dtype="float32", kv_cache_memory="16MiB")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=30, structured_outputs=constraint)
              for seed in range(3) for constraint in (StructuredOutputsParams(regex=regex),
                                                      StructuredOutputsParams(choice=choices))]
    outs = llm.generate(["id:"] * len(params), params, use_tqdm=False)
    for out, param in zip(outs, params):
        text, done = out.outputs[0].text, out.outputs[0].finish_reason
        assert done == "stop" and (re.fullmatch(regex, text) if param.structured_outputs.regex else text in choices)
    llm.engine.check_idle()


@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None, reason="sentence-transformers missing")
@pytest.mark.parametrize("arch,kind", [("BertModel", "mean"), ("XLMRobertaModel", "cls")])
def test_encoder_embeddings_on_the_gpu(tmp_path, arch, kind):
    from pooling_util import TEXTS, encoder_folder, write_st_modules

    path = write_st_modules(encoder_folder(tmp_path / "model", arch), kind, 64)
    options = dict(max_num_batched_tokens=32, max_model_len=32, kv_cache_memory="4MiB")
    cpu, gpu = ([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
                for llm in both(path, **options).values())
    cos = torch.nn.functional.cosine_similarity(torch.tensor(cpu), torch.tensor(gpu), dim=-1)
    assert cos.min().item() >= 0.9999
