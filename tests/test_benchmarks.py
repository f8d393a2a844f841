"""The benchmark kit in benchmarks/ runs from a clone with nothing beside it: the bench-model maker writes a folder
that aserve's own benchmark serves, and the comparison scripts say what they need instead of failing obscurely."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def test_bench_model_maker_writes_the_documented_shape_and_aserve_benchmarks_it(tmp_path):
    """The maker's model loads and runs in every weight format weight_formats.py compares (the `aserve bench
    throughput` report itself is checked on a tiny model in test_cli)."""
    out = tmp_path / "bench-model"
    made = subprocess.run([sys.executable, str(BENCH / "make_bench_model.py"), str(out), "--layers", "1",
                           "--corpus-bytes", "100000"], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["vocab_size"], config["num_hidden_layers"]) == (576, 9, 3, 49152, 1)
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == 10000.0
    formats = subprocess.run([sys.executable, str(BENCH / "weight_formats.py"), "--model", str(out), "--rounds", "1",
                              "--batch", "2", "--input-len", "8", "--output-len", "4", "--dtype", "float32",
                              "--formats", "dense,gptqh@4k,gptq4h@3steps,dense@fp8kv", "--probe", "0"],
                             capture_output=True, text=True, timeout=600)
    assert formats.returncode == 0, formats.stderr
    assert formats.stdout.startswith("weight_formats: CPU capability") and "2 x 8/4, 1 rounds" in formats.stdout
    assert re.search(r"^median output tok/s \(ratio to dense\): dense [0-9.]+ \(1.00x\), gptqh@4k [0-9.]+ \([0-9.]+x\), "
                     r"gptq4h@3steps [0-9.]+ \([0-9.]+x\), dense@fp8kv [0-9.]+ \([0-9.]+x\)", formats.stdout, re.M)
    assert re.search(r"bandwidth [0-9.]+ GB/s before, [0-9.]+ after", formats.stdout)
    assert re.search(r"^the 1 rounds at >= 0 GB/s: median output tok/s \(ratio to dense\): dense", formats.stdout, re.M)
    gptq = tmp_path / "bench-gptq4"
    quantized = subprocess.run([sys.executable, "-m", "aserve.bench.quantize_rtn", str(out), str(gptq), "--group-size",
                                "64", "--lm-head"], capture_output=True, text=True, timeout=600)
    assert quantized.returncode == 0, quantized.stderr
    rows = subprocess.run([sys.executable, str(BENCH / "row_kernels.py"), "--model", str(out), "--gptq", str(gptq),
                           "--formats", "dense,int8h,gptq", "--rounds", "1", "--rows", "2", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600)
    assert rows.returncode == 0, rows.stderr
    assert rows.stdout.startswith("row_kernels: CPU capability") and "2 row(s)" in rows.stdout
    for name in ("dense", "int8h", "gptq"):  # the 1-layer model: 4 projections and the head
        assert re.search(rf"^{name}: 5 projections, [0-9.]+ MB; kernels [0-9.]+ ms \([0-9.]+ GB/s\), reads [0-9.]+ ms "
                         r"\([0-9.]+ GB/s\); kernels / reads [0-9.]+", rows.stdout, re.M), rows.stdout


def test_weight_formats_names_take_their_suffixes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("weight_formats", BENCH / "weight_formats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_format("gptq4h") == ("gptq4h", False, 1, "auto")
    assert module.parse_format("dense@4k@8steps") == module.parse_format("dense@8steps@4k") == ("dense", True, 8, "auto")
    assert module.parse_format("int8h@fp8kv@2steps") == ("int8h", False, 2, "fp8")
    for bad in ("gptq5", "dense@2k", "dense@0steps", "dense@4k@4k", "dense@2steps@3steps", "dense@steps",
                "dense@fp8kv@fp8kv", "dense@fp8"):
        assert module.parse_format(bad) is None, bad


def test_weight_formats_rounds_find_nothing_in_the_prefix_cache():
    """Each round's prompts and the warm-up's differ from every other run's in their first block, so no round skips
    its prefill (one set reused had timed rounds after the first without it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("weight_formats", BENCH / "weight_formats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for count, batch, input_len in ((6, 64, 128), (10, 1, 16), (3, 16, 20)):
        sets = module.prompt_sets(count, batch, input_len)
        assert len(sets) == count and all(len(s) == batch for s in sets)
        assert all(len(p) == input_len and all(0 < t < 49152 for t in p) for s in sets for p in s)
        first_blocks = [tuple(p[:16]) for s in sets for p in s]
        assert len(set(first_blocks)) == count * batch


def test_comparison_scripts_parse_and_ask_for_vllm_when_it_is_missing(tmp_path):
    for script in ("setup_vllm_cpu.sh", "compare_throughput.sh", "compare_serve.sh"):
        assert subprocess.run(["bash", "-n", str(BENCH / script)]).returncode == 0, script
    env = dict(os.environ, VLLM_VENV=str(tmp_path / "no-vllm"))
    proc = subprocess.run(["bash", str(BENCH / "compare_throughput.sh"), str(tmp_path / "model")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "benchmarks/setup_vllm_cpu.sh" in proc.stderr
    assert proc.stdout.startswith("CPU: ")  # every figure carries the machine it came from


def test_decode_attention_benchmark_times_each_cache():
    """benchmarks/decode_attention.py runs the op over every cache format it offers and prints a line for each."""
    from aserve.ops import cpu_kernels

    if not cpu_kernels.available():
        import pytest

        pytest.skip("aserve's CPU kernels are not built here")
    common = [sys.executable, str(BENCH / "decode_attention.py"), "--batch", "2", "--context", "16", "--layers", "2",
              "--rounds", "1"]
    for dtype, plain in (("bfloat16", "bf16"), ("float32", "float32")):
        run = subprocess.run(common + ["--dtype", dtype, "--caches", f"{plain},fp8_e4m3,fp8_e5m2"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith("decode_attention: CPU capability")
        for name in (plain, "fp8_e4m3", "fp8_e5m2"):
            assert re.search(rf"^{name}: cold [0-9.]+ ms a layer .* hot [0-9.]+ .*time against {plain}: cold "
                             r"[0-9.]+x, hot [0-9.]+x$", run.stdout, re.M), run.stdout
    wrong = subprocess.run(common + ["--caches", "float32"], capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "in the queries' dtype" in wrong.stderr


def test_row_kernels_reads_what_the_roofline_counts_and_runs_each_projection(model_dirs):
    """benchmarks/row_kernels.py sets each projection's kernel against reading the tensors it reads: together they are
    the roofline's count of a step's weight bytes (packed panels where a dense weight is packed, not its plain copy;
    codes and scales), and each projection's run gives the module's product (silu(gate) * up where the gate | up
    weight is packed for it)."""
    import importlib.util

    import torch

    from aserve import LLM
    from aserve.bench import roofline

    spec = importlib.util.spec_from_file_location("row_kernels", BENCH / "row_kernels.py")
    row_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(row_kernels)
    for options in ({}, {"quantization": "int8", "quantize_lm_head": True}):
        llm = LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB", **options)
        model = llm.engine.runner.model
        found = row_kernels.projections(model)
        read = sum(t.numel() * t.element_size() for *_, tensors in found for t in tensors)
        assert read == roofline.ModelCost.of(model, llm.engine.runner.kv_cache).weight_bytes
        assert len(found) == 4 * model.shape.num_layers + 1
        for module, run, in_features, _ in found:
            x = torch.randn(3, in_features)
            with torch.inference_mode():
                out, plain = run(x), module(x)
            if out.shape == plain.shape:
                torch.testing.assert_close(out, plain)
            else:  # gate | up packed for SiLU-and-mul: the run is the gated product
                gate, up = plain.chunk(2, dim=-1)
                torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-4, atol=1e-5)
