"""Tiny random models built with transformers' own config classes, transformers as the reference, and waiting
for a state (never for a time)."""
from __future__ import annotations

import asyncio
import logging
import random
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch

from aserve.config import DEFAULT_MODEL_DIR

VOCAB = 4096  # the embedded default model's tokenizer, reused by every tiny model


def pytest_sessionstart(session):
    """Build (or load) aserve's CPU kernels once, before any test's timeout runs. A clean clone builds them in about
    two minutes, and the first test to need them, often an engine whose core process would build them itself, paid
    that under its own 180 s limit: on a slow or busy machine its setup timed out."""
    from aserve.ops import cpu_kernels

    cpu_kernels.available()

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1, bos_token_id=0, eos_token_id=0)
TOKENS = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)

# family -> (transformers config class, model class, config kwargs). Sliding windows are smaller than the
# test prompts plus outputs (up to 94 tokens), so the window really cuts the context.
FAMILIES = {
    "llama-gqa-tied": ("LlamaConfig", "LlamaForCausalLM",
                       dict(COMMON, tie_word_embeddings=True,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM",
                     dict(COMMON, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                          rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(COMMON, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, tie_word_embeddings=True, head_dim=32)),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", dict(COMMON, sliding_window=20, tie_word_embeddings=False)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(TOKENS, pad_token_id=1, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=512, word_embed_proj_dim=64, init_std=0.1, do_layer_norm_before=True)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(TOKENS, n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=512, initializer_range=0.1,
                  activation_function="gelu_new")),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(COMMON, pad_token_id=0, sliding_window=24, partial_rotary_factor=0.5)),
    # caps small enough to bend this model's logits (at Gemma 2's own 50/30 they would change nothing here);
    # the final cap is monotonic, so only the logprobs tests can see it
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(COMMON, pad_token_id=0, head_dim=16, sliding_window=16, query_pre_attn_scalar=12,
                    attn_logit_softcapping=1.0, final_logit_softcapping=2.0, hidden_activation="gelu_pytorch_tanh")),
}


def build_tiny_model(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """`overrides`: config fields changed from the family's (e.g. num_key_value_heads=1)."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


@pytest.fixture
def caplog(caplog, monkeypatch):
    """The aserve logger has its own handler and does not propagate; let caplog see it for the test."""
    monkeypatch.setattr(logging.getLogger("aserve"), "propagate", True)
    return caplog


@pytest.fixture
def pick_gemm(monkeypatch):
    """pick_gemm("aserve" | "onednn"): the dense GEMM (cpu_gemm.gemm_for) for this test, whichever this CPU would
    pick (aserve's where it is built, oneDNN's for the pooling runner's bf16 weights on CPUs with AMX tiles)."""
    from aserve.ops import cpu_gemm

    def pick(name: str) -> None:
        monkeypatch.setenv("ASERVE_GEMM", name)
        cpu_gemm.gemm_for.cache_clear()
    yield pick
    cpu_gemm.gemm_for.cache_clear()


@pytest.fixture
def bf16_products():
    """products(name): what multiplies aserve's bf16 GEMMs in this test (gemm_bf16_products: "fma", "dpbf16" or,
    where the CPU lends AMX tiles, "amx"), put back after. Skips where the bf16 GEMM is not built (no AVX512-BF16)."""
    from aserve.ops import cpu_kernels

    if not cpu_kernels.available() or not torch.ops.aserve.gemm_packs_bf16():
        pytest.skip("aserve's bf16 GEMM needs AVX512-BF16")
    before = torch.ops.aserve.gemm_bf16_products()
    yield torch.ops.aserve.gemm_bf16_products
    torch.ops.aserve.gemm_bf16_products(before)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: build_tiny_model(root / family, family) for family in FAMILIES}


def load_reference(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def reference_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own generate, one prompt at a time (no padding), stopping at eos like the engine."""
    outs = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 pad_token_id=0, eos_token_id=0)
        outs.append(seq[0, len(ids):].tolist())
    return outs


def random_prompts(count: int, lengths=(3, 60), seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = prefix or []
    return [prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def watch_swaps(runner, nonzero: bool = False) -> list[int]:
    """Wrap the runner's swap_out/swap_in: each block swapped out must land byte-exact in the host pool and come
    back byte-exact (with `nonzero`, hold real K/V, not zeros). Returns the host blocks checked on the way back."""
    saved, checked = {}, []
    real_out, real_in = runner.swap_out, runner.swap_in

    def swap_out(pairs):
        before = {h: runner.kv_cache[:, :, :, d].cpu().clone() for d, h in pairs}  # the cache may be on a GPU
        real_out(pairs)
        for h, content in before.items():
            assert torch.equal(runner.host_cache[:, :, :, h], content)
            assert not nonzero or content.abs().sum() > 0
            saved[h] = content

    def swap_in(pairs):
        real_in(pairs)
        for h, d in pairs:
            assert torch.equal(runner.kv_cache[:, :, :, d].cpu(), saved.pop(h))
            checked.append(h)

    runner.swap_out, runner.swap_in = swap_out, swap_in
    return checked


def scattered_tables(need: list[int], null: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables over a random permutation of physical blocks 0..null-1, request i owning need[i] of them,
    padded with the null block: blocks lie anywhere in the cache, as after real traffic."""
    physical = torch.randperm(null, generator=gen)
    tables = torch.full((len(need), max(need)), null, dtype=torch.long)
    used = 0
    for i, k in enumerate(need):
        tables[i, :k] = physical[used:used + k]
        used += k
    return tables


def make_layout(requests, block_size: int, gen: torch.Generator, num_short: int = 0):
    """The runner's layout (model_runner._prepare) over a random permutation of physical blocks; the last
    block is the null block that pads the tables. `num_short`: the requests after the decodes that run a short
    chunk past their prompts (backend.batch_order 1)."""
    need = [-(-(start + n) // block_size) for start, n in requests]
    null = sum(need)
    tables = scattered_tables(need, null, gen)
    starts, counts = [s for s, _ in requests], [n for _, n in requests]
    positions = torch.cat([torch.arange(s, s + n) for s, n in requests])
    row = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor(counts))
    slots = tables[row, positions // block_size] * block_size + positions % block_size
    num_decode = sum(1 for n in counts if n == 1)
    from aserve.attention import BatchLayout

    return BatchLayout(positions, slots, tables, starts, counts, num_decode, block_size, null + 1, num_short)


def poison_sampler(monkeypatch, first_token: int, after_tokens: int = 0, value: float = float("nan")) -> None:
    """From now on the sampler sees `value` for every logit of a request whose prompt starts with `first_token` once
    it has `after_tokens` output tokens: what a model fault leaves for that request alone. Every step then samples
    through the sampler: greedy decode rows do not take the model's one-call greedy steps (whose faults
    test_multi_step's NaN embedding row makes inside the model)."""
    from aserve.worker import model_runner

    real_sample = model_runner.sample

    def poisoned(logits, reqs, *rest):
        for i, req in enumerate(reqs):
            if req.prompt_token_ids[0] == first_token and req.num_output_tokens >= after_tokens:
                logits[i] = value
        return real_sample(logits, reqs, *rest)

    monkeypatch.setattr(model_runner, "sample", poisoned)
    monkeypatch.setattr(model_runner.ModelRunner, "_one_call", lambda self, reqs: False)


def kv_memory_for_blocks(path: Path, num_blocks: int, block_size: int = 16, dtype_bytes: int = 4) -> int:
    """KV cache bytes for exactly `num_blocks` blocks, from the model's own shape (config names differ by family)."""
    from aserve.models.registry import architecture, model_class, read_config

    config = read_config(path)
    with torch.device("meta"):
        s = model_class(architecture(config)).from_config(config).shape
    return num_blocks * 2 * s.num_layers * block_size * s.num_kv_heads * s.head_dim * dtype_bytes


POISON = 4000  # the token whose embedding row the NaN model corrupts


@pytest.fixture(scope="session")
def nan_model(model_dirs, tmp_path_factory):
    """The untied tiny Llama with one embedding row set to NaN: any request holding that token (in its prompt
    or its output) gets NaN hidden states, K/V and logits, a real fault rather than a patched one."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("nan-model")
    for f in model_dirs["llama-untied"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# -- waiting for a state, never for a time -------------------------------------------------------------

PATIENCE = 60.0  # seconds; only a hung engine misses it, however loaded the CI machine


def wait_for(probe, ok=bool, what: str = "the awaited state", timeout: float = PATIENCE):
    """Call `probe()` until `ok` holds for its value and return that value. The deadline only turns a hang into
    a failure naming `what` and the last value seen; no test waits a fixed time for something to happen."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not come within {timeout:g} s; last seen: {value!r}")
        time.sleep(0.05)


async def until(probe, ok=bool, what: str = "the awaited state", timeout: float = PATIENCE):
    """`wait_for` for an async probe (an AsyncLLM's state, a request made with httpx.AsyncClient)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not come within {timeout:g} s; last seen: {value!r}")
        await asyncio.sleep(0.05)


def is_idle(state: dict) -> bool:
    """Nothing live on either side of the core and every block free: what a test proves after its traffic."""
    return (state["num_live_requests"] == state["num_collectors"] == 0 and state["num_running"] == 0
            and state["num_waiting"] == state["num_swapped"] == 0 and state["num_free_blocks"] == state["num_blocks"])


def server_state(url: str, api_key: str | None = None) -> dict:
    """A server's /state (it needs the API key when the server has one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/state", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(url: str, api_key: str | None = None) -> dict:
    """Wait for a server to be idle (requests just aborted or timed out are freed a moment later)."""
    return wait_for(lambda: server_state(url, api_key), is_idle, f"{url} to be idle")


async def engine_idle(engine) -> dict:
    """Wait for an AsyncLLM to be idle; return its state."""
    return await until(engine.state, is_idle, "the engine to be idle")
