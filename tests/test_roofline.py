"""`aserve bench roofline`: the bandwidth kernel reads what it is given, the work it counts is the work the model did,
and the report prints every figure it promises. No timing is asserted (figures depend on the machine)."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time

import numpy as np
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.bench import roofline
from aserve.models.layers import Linear
from aserve.ops import cpu_kernels
from conftest import random_prompts

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")


def test_stream_read_reads_every_word():
    """The xor of every 64-bit word, over sizes that end mid-chunk; a strided view or a ragged size is refused."""
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(0)
    for words in (1, 7, (1 << 14) + 3, 5 * (1 << 14)):
        buffer = torch.randint(-2**62, 2**62, (words,), dtype=torch.int64, generator=gen)
        assert torch.ops.aserve.stream_read(buffer) == int(np.bitwise_xor.reduce(buffer.numpy()))
        assert torch.ops.aserve.stream_read(buffer.view(torch.uint8)) == torch.ops.aserve.stream_read(buffer)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.aserve.stream_read(torch.zeros(8, 2, dtype=torch.int64).t())
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.aserve.stream_read(torch.zeros(5, dtype=torch.uint8))


@pytest.mark.parametrize("steps", [1, 4])
def test_work_counted_is_the_work_done(model_dirs, steps):
    """Prompts of 20 tokens, 5 tokens out, prefix caching off: every prompt token and every output token but the
    last goes through the layers once, every output token through the head once; FLOPs and bytes follow from the
    model's sizes, a forward at a time also where a batch decodes 4 steps a scheduling. The profiled run's split
    covers its wall time."""
    llm = LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB",
              enable_prefix_caching=False, num_scheduler_steps=steps)
    runner = llm.engine.runner
    cost = roofline.ModelCost.of(runner.model, runner.kv_cache)
    model = runner.model
    layers = sum(m.in_features * m.out_features for m in model.layers.modules() if isinstance(m, Linear))
    assert cost.formats == "unquantized" and cost.layer_params == layers
    assert cost.head_params == model.embed_tokens.weight.numel()  # tied: the head is the embedding
    assert cost.weight_bytes == 4 * (cost.layer_params + cost.head_params)
    prompts = random_prompts(3, lengths=(20, 20), seed=2)
    peaks = roofline.Peaks(100.0, (1, 1, 1), 10.0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=5)
    run = roofline.measure(llm, prompts, params, peaks, random_prompts(3, lengths=(20, 20), seed=3))
    work = run.work
    assert run.output_tokens == 15 and work.steps == 5
    assert work.tokens == 3 * 20 + 3 * 4 and work.sampled_rows == 15
    assert work.gemm_flops == 2.0 * (cost.layer_params * work.tokens + cost.head_params * work.sampled_rows)
    pairs = 3 * (20 * 21 // 2 + sum(range(21, 25)))  # causal prefill, then one query over 21..24 keys
    assert work.attention_flops == cost.attention_flops * pairs
    assert work.bytes_read == 5 * cost.weight_bytes + cost.kv_bytes * 3 * (20 + sum(range(21, 25)))
    assert 0 < work.roofline_seconds and work.compute_bound_steps <= work.steps
    seconds, compute_bound = work.bound(peaks)  # what the report computes after the run, with the final peaks
    assert seconds == pytest.approx(work.roofline_seconds) and compute_bound == work.compute_bound_steps
    faster = dataclasses.replace(peaks, bandwidth_gbs=2 * peaks.bandwidth_gbs)
    assert work.bound(faster)[0] < seconds
    assert set(run.split) == {"GEMM", "attention", "other ops", "Python and scheduling"}
    assert all(seconds >= 0 for seconds in run.split.values()) and run.split["GEMM"] > 0
    assert sum(run.split.values()) == pytest.approx(run.profiled_wall, rel=0.05)
    assert not hasattr(llm.engine.executor, "execute") or "execute" not in vars(llm.engine.executor)


def test_gemm_ceiling_is_the_gemms_at_the_peak_plus_the_rest_as_it_was():
    """A run of 10 s whose profile gave the GEMMs 8 of 12.5 s (64%): the rest is 36% of the timed wall, 3.6 s. Its
    1200 GFLOP at 200 GFLOP/s take 6 s: at most 6 / 9.6 of the peak; a faster peak leaves the rest a larger share."""
    run = roofline.Run(10.0, 100, roofline.Work(gemm_flops=1200e9),
                       split={"GEMM": 8.0, "attention": 3.0, "other ops": 1.0, "Python and scheduling": 0.5},
                       profiled_wall=12.5)
    assert roofline.gemm_ceiling(run, 200.0) == pytest.approx(6.0 / 9.6)
    assert roofline.gemm_ceiling(run, 400.0) == pytest.approx(3.0 / 6.6)
    run.split["GEMM"] = 12.5  # nothing outside the GEMMs: nothing caps the run
    assert roofline.gemm_ceiling(run, 200.0) == pytest.approx(1.0)


def test_attention_ceiling_puts_attention_at_its_k_v_reads():
    """The run above, its attention reading 40 GB of K/V: at 20 GB/s its floor is 2 s of the 3 it took under the
    profiler (3.6 s of the timed wall outside the GEMMs, of which attention's share is 2.4 s): the GEMMs' 6 s, the
    floor's 2 and the other 1.2 s reach 6 / 9.2 of the peak; at a bandwidth that makes the floor nothing, 6 / 7.2."""
    work = roofline.Work(gemm_flops=1200e9, step_costs=[(0.0, 0.0, 0.0, 40e9)])
    run = roofline.Run(10.0, 100, work, split={"GEMM": 8.0, "attention": 3.0, "other ops": 1.0,
                                               "Python and scheduling": 0.5}, profiled_wall=12.5)
    assert work.kv_bytes == 40e9
    assert roofline.attention_ceiling(run, 200.0, 20.0) == pytest.approx(6.0 / 9.2)
    assert roofline.attention_ceiling(run, 200.0, 1e12) == pytest.approx(6.0 / 7.2, rel=1e-3)
    assert roofline.attention_ceiling(run, 200.0, 20.0) > roofline.gemm_ceiling(run, 200.0)
    # a bandwidth under what attention read at (K/V in the caches) leaves it the time it took: gemm_ceiling's
    assert roofline.attention_ceiling(run, 200.0, 1.0) == pytest.approx(roofline.gemm_ceiling(run, 200.0))


def test_probes_between_steps_stay_out_of_the_timing(model_dirs):
    """Probes with no interval read both peaks before every call of the executor (the 4 steps that run the model and
    the last, which only frees the requests), outside the run's timed wall; with a long one, once, before the first
    step. Readings are rates (no value asserted: they depend on the machine)."""
    llm = LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="16MiB",
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    for interval, expected in ((0.0, 5), (3600.0, 1)):
        probes = roofline.Probes.make(interval, torch.float32, (128, 512, 512), 1)
        start = time.perf_counter()
        run = roofline.measure(llm, random_prompts(2, lengths=(10, 10), seed=4 + expected), params, None,
                               probes=probes)
        elapsed = time.perf_counter() - start
        assert run.probes is probes and run.work.steps == 4 and len(probes.readings) == expected
        assert all(gemm > 0 and read > 0 for gemm, read in probes.readings) and probes.seconds > 0
        assert run.wall < elapsed - probes.seconds + 1e-9  # the probes' time is not the run's
        gemm, read = probes.medians()
        assert gemm in [g for g, _ in probes.readings] and read in [r for _, r in probes.readings]


def test_int8_weights_count_a_quarter_of_fp32_bytes(model_dirs):
    dense, int8 = (roofline.ModelCost.of(llm.engine.runner.model, llm.engine.runner.kv_cache) for llm in (
        LLM(str(model_dirs["llama-untied"]), dtype="float32", kv_cache_memory="16MiB", quantization=q)
        for q in (None, "int8")))
    assert (int8.formats, int8.head_format, dense.formats) == ("int8", "unquantized", "unquantized")
    assert int8.layer_params == dense.layer_params
    head = 4 * int8.head_params  # the untied head stays dense unless --quantize-lm-head
    assert (dense.weight_bytes - head) / 4 <= int8.weight_bytes - head < (dense.weight_bytes - head) / 3


def test_roofline_command_prints_every_figure(model_dirs, capsys):
    from aserve.cli import build_parser

    args = build_parser().parse_args(["bench", "roofline", "--model", str(model_dirs["llama-gqa-tied"]),
                                      "--num-prompts", "2", "--input-len", "12", "--output-len", "3",
                                      "--bandwidth-mib", "32", "--kv-cache-memory", "16MiB"])
    roofline.main(args)
    out = capsys.readouterr().out
    for pattern in (r"flags: [a-z0-9_ ]+\)", r"peak GEMM: \d+ GFLOP/s",
                    r"memory bandwidth: [\d.]+ GB/s .*the slowest [\d.]+\)",
                    r"memory bandwidth after the run: [\d.]+ GB/s .*the fractions below use [\d.]+",
                    r"GEMM: [\d.]+ GFLOP, \d+ GFLOP/s over the whole run = \d+% of the peak",
                    r"= \d+% of the bandwidth", r"reached \d+% of the machine's limit", r"\| GEMM \| [\d.]+ \| \d+% \|",
                    r"\| Python and scheduling \|", r"inside the GEMMs: \d+ GFLOP/s",
                    r"peaks read during the run \(\d+ probes, [\d.]+ s kept out of the timing\): GEMM median \d+ "
                    r"GFLOP/s \(\d+-\d+\), bandwidth median [\d.]+ GB/s .*against the medians: GEMM \d+% of the peak, "
                    r"memory \d+% of the bandwidth, \d+% of the limit", r"\d+% of the probes' median\)",
                    r"outside the GEMMs \(attention \d+%, other ops \d+%, Python and scheduling \d+% of the time\): "
                    r"with every GEMM at the peak, the run would reach \d+% of the peak "
                    r"\(\d+% of the probes' median\)",
                    r"inside attention: [\d.]+ GB of K/V at [\d.]+ GB/s = \d+% of the bandwidth .*with every GEMM at "
                    r"the peak and attention reading its K/V at the bandwidth, the run would reach \d+% of the peak"):
        assert re.search(pattern, out), (pattern, out)
    assert re.search(r"Throughput: [0-9.]+ requests/s", out.splitlines()[-1])
    # both peaks are read again after the run, and the fractions use the higher reading of each
    before = float(re.search(r"peak GEMM: (\d+) GFLOP/s", out).group(1))
    after, used = map(float, re.search(r"peak GEMM after the run: (\d+) GFLOP/s; the fractions below use (\d+)",
                                       out).groups())
    assert used == max(before, after)
    with pytest.raises(SystemExit, match="one process"):
        roofline.main(build_parser().parse_args(["bench", "roofline", "--tensor-parallel-size", "2"]))
