"""models.flat_forward: the straight-line CPU forward of Llama-family stacks is the modules' forward, bit for bit.

bf16 weights are packed here even where the CPU emulates bf16 (the loader packs only native dtypes), so the
path runs in both dtypes wherever oneDNN can pack bf16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); on an AVX2-only CPU
it cannot, the flat path never builds in bf16 (it needs packed weights), and only the fp32 cases run. Token-for-token parity with transformers through this path
is tests/test_parity.py's (its Llama-family models take it on every step the kernel covers).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import aserve.attention.torch_backend as torch_backend
from aserve.attention import kv_quant
from aserve import LLM, SamplingParams
from aserve.models.flat_forward import UNBUILT, FlatForward
from aserve.ops import cpu_gemm, cpu_kernels
from conftest import random_prompts

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(5, lengths=(3, 40), seed=11)]


def set_loop(loop: str, monkeypatch, pick_gemm) -> None:
    """`native`: the C++ loop over whichever GEMM this CPU picks (oneDNN's with AMX tiles, aserve's elsewhere);
    `native-onednn`: the C++ loop over oneDNN's packed weights on any CPU; `python`: ASERVE_NATIVE_LOOP=0."""
    if loop == "python":
        monkeypatch.setenv("ASERVE_NATIVE_LOOP", "0")
    elif loop == "native-onednn":
        pick_gemm("onednn")


def run(path, dtype, flat: bool, team_rows: int | None = None, **options):
    """Greedy outputs and every forward's hidden states, with the flat path on or off, and how many forwards
    it ran. `team_rows`: the C++ loop's steps of up to this many rows run as one team of threads (0: none)."""
    llm = LLM(str(path), dtype=dtype, device="cpu", kv_cache_memory="16MiB", **options)
    # every step through the model's forward, whose hidden states these tests compare (the decode steps that run
    # in one call of the C++ stack, head and argmax included, are test_multi_step's)
    llm.engine.runner._one_call = lambda reqs: False
    model = llm.engine.runner.model
    cpu_gemm.prepack_linears(model, model.embed_tokens.weight.dtype)  # bf16 too, native or not
    if not flat:
        model.flat = None
    hidden, forward = [], model.forward

    def recorded(*args):
        out = forward(*args)
        hidden.append(out.clone())
        return out
    model.forward = recorded
    used = []
    call = FlatForward.__call__

    def counted(self, *args):
        used.append(1)
        if team_rows is not None and self.stack is not None:
            self.stack.set_team_rows(team_rows)
        return call(self, *args)
    FlatForward.__call__ = counted
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        FlatForward.__call__ = call
    return tokens, hidden, len(used), model


@pytest.mark.parametrize("loop", ["native", "native-onednn", "python"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama-untied", "qwen3", "phi3"])
def test_flat_forward_is_the_modules_forward_bit_for_bit(model_dirs, monkeypatch, pick_gemm, family, dtype, loop):
    """Biases in every linear layer (llama-untied), q/k norms (qwen3), a sliding window and partial rotary
    (phi3). Prompts of 3 to 40 tokens: steps of prefill chunks alone, then mixed with decode rows, then decode
    rows alone, every one through the flat path: its C++ loop (ops/csrc/decoder_stack.cpp) over either GEMM's
    packed weights or, with ASERVE_NATIVE_LOOP=0, the Python one."""
    if not cpu_gemm.can_pack(getattr(torch, dtype)):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU, so the flat path does not run in {dtype}")
    set_loop(loop, monkeypatch, pick_gemm)
    tokens, hidden, used, model = run(model_dirs[family], dtype, flat=True)
    assert isinstance(model.flat, FlatForward) and used == len(hidden) > 0
    assert (model.flat.stack is not None) == loop.startswith("native")
    if loop == "native-onednn":
        assert not model.layers[0].mlp.down_proj.packed.aserve
    ref_tokens, ref_hidden, ref_used, _ = run(model_dirs[family], dtype, flat=False)
    assert ref_used == 0 and tokens == ref_tokens and len(hidden) == len(ref_hidden)
    assert all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))


@pytest.mark.parametrize("loop", ["native", "python"])
@pytest.mark.parametrize("weights", ["int8", "int8-no-bias", "gptq", "gptq-no-bias"])
def test_quantized_models_take_the_flat_forward_bit_for_bit(model_dirs, monkeypatch, tmp_path, weights, loop):
    """int8 weights (aserve's tiled kernel for decode rows, its int8 GEMM for prefill chunks) and GPTQ int4
    (aserve's int4 kernels) run each projection through their method in the Python loop, and as the same kernels
    in the C++ one, as through the modules. Without biases (llama-gqa-tied), int8's and int4's gate | up is tiled
    for the GEMM's SiLU-and-mul epilogue, which all three paths take."""
    from aserve.bench.quantize_rtn import write_rtn_checkpoint

    if loop == "python":
        monkeypatch.setenv("ASERVE_NATIVE_LOOP", "0")
    source = model_dirs["llama-gqa-tied" if weights.endswith("no-bias") else "llama-untied"]
    path, options = source, {}
    if weights.startswith("int8"):
        options["quantization"] = "int8"
    else:
        path = tmp_path / "gptq"
        write_rtn_checkpoint(source, path, "gptq")
    # bf16 where aserve's int8 and int4 kernels take bf16 rows (AVX512-BF16); elsewhere fp32, where they always do
    dtype = "bfloat16" if cpu_kernels.available() and torch.ops.aserve.gemm_packs_bf16() else "float32"
    tokens, hidden, used, model = run(path, dtype, flat=True, **options)
    assert isinstance(model.flat, FlatForward) and used == len(hidden) > 0
    assert model.layers[0].mlp.down_proj.method.name.startswith(weights[:4])
    assert (model.flat.stack is not None) == (loop == "native")
    gated = getattr(model.layers[0].mlp.gate_up_proj, "int8_gated", False)
    assert gated == (weights == "int8-no-bias")
    int4_gated = getattr(model.layers[0].mlp.gate_up_proj, "int4_gated", False)
    assert int4_gated == (weights == "gptq-no-bias")
    ref_tokens, ref_hidden, ref_used, _ = run(path, dtype, flat=False, **options)
    assert ref_used == 0 and tokens == ref_tokens and len(hidden) == len(ref_hidden)
    assert all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "gptq"])
def test_small_steps_run_as_one_team_bit_for_bit(model_dirs, tmp_path, weights):
    """The C++ loop runs a step of up to its team_rows rows (decode rows here, and the 3-token prompt's prefill)
    as one team of threads (ops/csrc/step_team.h), whose kernels split their work as at::parallel_for does: the
    same hidden states as with team_rows 0, one OpenMP region a kernel. A team runs wherever there are two
    threads and a CPU for each."""
    from aserve.bench.quantize_rtn import write_rtn_checkpoint

    path, dtype, options = model_dirs["llama-untied"], weights, {}
    if weights in ("int8", "gptq"):
        dtype = "bfloat16" if cpu_kernels.available() and torch.ops.aserve.gemm_packs_bf16() else "float32"
        if weights == "int8":
            options["quantization"] = "int8"
        else:
            path = tmp_path / "gptq"
            write_rtn_checkpoint(model_dirs["llama-untied"], path, "gptq")
    elif not cpu_gemm.can_pack(getattr(torch, dtype)):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU, so the flat path does not run in {dtype}")
    tokens, hidden, used, model = run(path, dtype, flat=True, **options)
    stack = model.flat.stack
    assert stack is not None and stack.team_rows() == 8
    teams = torch.get_num_threads() > 1 and len(os.sched_getaffinity(0)) >= torch.get_num_threads()
    packed = getattr(model.layers[0].mlp.down_proj, "packed", None)
    own_gemms = packed is None or packed.aserve  # not oneDNN's, whose regions would run on one thread in a team
    assert (stack.team_steps() > 0) == (teams and own_gemms)
    ref_tokens, ref_hidden, _, ref_model = run(path, dtype, flat=True, team_rows=0, **options)
    assert ref_model.flat.stack.team_steps() == 0
    assert tokens == ref_tokens and len(hidden) == len(ref_hidden)
    assert all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))


@pytest.mark.parametrize("loop", ["native", "python"])
@pytest.mark.parametrize("scales", ["estimated", "fixed"])
def test_fp8_caches_take_the_flat_forward_bit_for_bit(model_dirs, monkeypatch, scales, loop):
    """An FP8 cache runs through the flat forward as through the modules: write_kv, decode and prefill attention
    by the format's code and each layer's scales. Scales estimated from each layer's first batch
    (--calculate-kv-scales) are taken in the Python loop's first step and handed to the C++ loop after it; fixed
    ones (1.0 here, as without a checkpoint's) from the first step."""
    if loop == "python":
        monkeypatch.setenv("ASERVE_NATIVE_LOOP", "0")
    options = dict(kv_cache_dtype="fp8", calculate_kv_scales=scales == "estimated")
    tokens, hidden, used, model = run(model_dirs["llama-untied"], "float32", flat=True, **options)
    assert isinstance(model.flat, FlatForward) and used == len(hidden) > 0
    assert (model.flat.stack is not None) == (loop == "native")
    if loop == "native":  # told of the format, with the scales as they stand after the first step
        assert model.flat.stack_kv_format == kv_quant.resolve("fp8").code > 0
    ref_tokens, ref_hidden, ref_used, ref_model = run(model_dirs["llama-untied"], "float32", flat=False, **options)
    assert ref_used == 0 and tokens == ref_tokens and len(hidden) == len(ref_hidden)
    assert all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))
    got = [(layer.attn.k_scale, layer.attn.v_scale) for layer in model.flat.layers]
    want = [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in ref_model.layers]
    assert got == want and (scales == "fixed") == all(s == (1.0, 1.0) for s in got)


def test_flat_forward_stays_out_of_what_it_does_not_run(model_dirs, monkeypatch):
    """Another layer type (Gemma 2), a gradient being recorded, a projection that is not one of aserve's linear
    layers and ASERVE_FLAT_FORWARD=0 all leave the modules' forward in charge; an unpacked dense weight (as with
    ASERVE_PREPACK=0) runs in the loop through its method."""
    *_, used, model = run(model_dirs["gemma2"], "float32", flat=True)
    assert not isinstance(model.flat, FlatForward) and used == 0  # its own forward never builds one
    assert not FlatForward.takes(object())
    with torch.enable_grad():  # the kernels have no autograd
        assert not FlatForward.takes(type("Meta", (), {"backend": torch_backend.TorchAttentionBackend()})())
    plain = LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", device="cpu", kv_cache_memory="16MiB").engine
    plain_model = plain.runner.model
    assert plain_model.flat is UNBUILT
    with torch.inference_mode():
        assert FlatForward.build(plain_model) is not None
    plain_model.layers[0].mlp.down_proj.packed = None  # as with ASERVE_PREPACK=0
    assert FlatForward.build(plain_model) is not None
    down = plain_model.layers[0].mlp.down_proj
    plain_model.layers[0].mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)
    assert FlatForward.build(plain_model) is None
    monkeypatch.setenv("ASERVE_FLAT_FORWARD", "0")
    *_, used, model = run(model_dirs["llama-gqa-tied"], "float32", flat=True)
    assert model.flat is None and used == 0


def test_native_loop_refuses_what_it_cannot_run():
    """DecoderStack's own checks: an unknown projection kind, int8 without scales, SiLU-and-mul on oneDNN's
    projection or one that is not a layer's gate_up, a layer naming a projection it does not hold, caches that
    are not a key and a value per layer, a step before the caches are set."""
    from aserve.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("aserve's CPU kernels are not built here")
    cos = sin = torch.zeros(8, 4)
    stack = torch.classes.aserve.DecoderStack(cos, sin, 4)
    weight = torch.zeros(2, 2)
    with pytest.raises(RuntimeError, match="unknown projection kind"):
        stack.add_projection(7, weight, None, None, None, 0, 2, 0, 0)
    with pytest.raises(RuntimeError, match="need their scales"):
        stack.add_projection(1, weight, None, None, None, 0, 2, 8, 0)
    with pytest.raises(RuntimeError, match="only a dense, int8 or int4 projection applies an activation"):
        stack.add_projection(3, weight, None, None, None, 0, 2, 0, 3)
    p = stack.add_projection(0, weight, None, None, None, 0, 2, 0, 0)
    gated = stack.add_projection(0, weight, None, None, None, 0, 2, 0, 3)
    norm = torch.ones(2)
    with pytest.raises(RuntimeError, match="only gate_up may apply SiLU and mul"):
        stack.add_layer(norm, 1e-5, p, 1, 1, 1, 1, 1, 1.0, 0, 1.0, 1.0, None, 0.0, None, 0.0, p, norm, 1e-5, p, gated)
    with pytest.raises(RuntimeError, match="no projection 3"):
        stack.add_layer(norm, 1e-5, p, 1, 1, 1, 1, 1, 1.0, 0, 1.0, 1.0, None, 0.0, None, 0.0, 3, norm, 1e-5, p, p)
    stack.add_layer(norm, 1e-5, p, 1, 1, 1, 1, 1, 1.0, 0, 1.0, 1.0, None, 0.0, None, 0.0, p, norm, 1e-5, p, p)
    x = torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match="set_caches first"):
        stack.forward(x, None, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1, None, None,
                      None, None, None)
    with pytest.raises(RuntimeError, match="a key and a value cache per layer"):
        stack.set_caches([torch.zeros(1, 1, 1, 1)])
    stack.set_caches([torch.zeros(1, 1, 1, 1)] * 2)
    with pytest.raises(RuntimeError, match="need their block tables"):
        stack.forward(x, None, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1, None, None,
                      None, None, None)
    # A kernel's error inside the layers (the dense projection's weight was never packed) ends the step, run as a
    # team where there are threads for one, and the stack runs its next step.
    tables, context = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for rows in (stack.team_rows(), 0):
        stack.set_team_rows(rows)
        with pytest.raises(RuntimeError, match="gemm_packed"):
            stack.forward(x, None, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1, tables,
                          context, None, None, None)
    assert stack.team_steps() == 0  # none finished
