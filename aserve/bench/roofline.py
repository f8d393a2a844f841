"""`aserve bench roofline`: how close a workload runs to this machine's limits, and where the rest of the time goes.

First it measures the machine, with aserve's own kernels: the peak rate of the GEMM that multiplies the model's
weights (in the run's dtype, on shapes large enough to be compute-bound) and the memory bandwidth (`stream_read`,
csrc/memory_stream.cpp: every byte of a buffer far larger than the caches read once, on all threads). Then it runs the
workload (`bench throughput`'s: random prompts, fixed lengths, ignore_eos) and counts, step by step from what the
scheduler hands the worker, the work the model did: GEMM FLOPs (2 per weight per token through the layers, and per
sampled row through the head), attention FLOPs (4 * head_dim per query head, layer, query token and context token)
and bytes read (every weight once a step, as stored: int8 and int4 read fewer; each query's K/V context). A step's
least possible time is that of its linear layers, the larger of their FLOPs at the peak rate and their weights at
the bandwidth, plus that of its attention, the same for its FLOPs and its K/V (the two run one after the other);
their sum over the steps is the roofline time, and roofline time / wall time is how close the run came (1.0 = at
the machine's limit). Both peaks are measured again after the workload and the higher reading of each is used. Both
are also probed during the run, between steps every --probe-interval seconds (outside the timed wall): a shared VM
changes speed within minutes, and the fractions against the probes' medians say how close the run came to what the
machine could do while it ran.

Last, the same workload runs again under torch.profiler and its wall time is split into GEMM (every linear layer's
kernel, quantized ones included), attention (its kernels and the KV cache writes), other ops (norms, rotary,
activation, sampling, copies) and Python and scheduling (the wall time no op accounts for). The profiler's own cost
makes that run somewhat slower; the split is its shares.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aserve.bench.sampling import add_sampling_arguments, sampling_options
from aserve.config import EngineConfig, add_engine_arguments, engine_options

# torch is imported where it is used: the `aserve` command imports this module to build its parser, and a command
# that fails on its arguments should say so before spending seconds importing torch.
if TYPE_CHECKING:
    import torch

PEAK_SHAPES = ((256, 2048, 2048), (512, 1024, 4096), (1024, 2048, 2048))  # (rows, in, out): compute-bound
GROUPS = (  # (label, substrings of profiler op names), first match wins; the rest is "other ops"
    ("GEMM", ("gemm_packed", "gemm_int8", "gemm_int4", "int8_linear", "int4_linear", "int8_untile",
              "_linear_pointwise", "_weight_int8pack_mm", "_weight_int4pack_mm", "lora_delta", "aten::linear",
              "aten::mm", "aten::addmm", "aten::matmul")),
    ("attention", ("paged_decode_attention", "paged_prefill_attention", "write_kv", "scaled_dot_product_attention",
                   "aten::bmm", "index_copy", "_softmax")),
)
CPU_FLAGS_SHOWN = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512vbmi", "avx512_fp16", "amx_bf16",
                   "amx_int8")  # avx512vbmi: FP8 decode attention on vdpbf16ps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    add_sampling_arguments(parser)
    parser.add_argument("--bandwidth-mib", type=int, default=1024,
                        help="size of the buffer streamed to measure memory bandwidth (far larger than the caches)")
    parser.add_argument("--probe-interval", type=float, default=2.0,
                        help="seconds between the peak probes taken during the run, between steps and outside its "
                             "timed wall; they hold a --bandwidth-mib buffer through the run (0: none)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled run and its time split")
    add_engine_arguments(parser)


# -- the machine ------------------------------------------------------------------------------------------------


@dataclass
class Peaks:
    gemm_gflops: float  # the packed GEMM's best rate, run dtype
    gemm_shape: tuple[int, int, int]
    bandwidth_gbs: float  # stream_read's best rate
    bandwidth_slowest_gbs: float = 0.0  # and its slowest: a shared VM's memory bandwidth drifts


def gemm_runner(dtype: torch.dtype, shape: tuple[int, int, int]):
    """A call of the GEMM the engine multiplies `dtype` weights with (ops.cpu_gemm: aserve's or oneDNN's, prepacked;
    torch's linear where neither packs this dtype) on random operands of `shape` (rows, in, out)."""
    import torch

    from aserve.ops import cpu_gemm

    rows, inp, out = shape
    x, w = torch.randn(rows, inp, dtype=dtype), torch.randn(out, inp, dtype=dtype)
    if cpu_gemm.can_pack(dtype):
        packed = cpu_gemm.pack_weight(w)
        return lambda: cpu_gemm.packed_linear(x, packed, None)
    return lambda: torch.nn.functional.linear(x, w)


def gemm_rate(run, shape: tuple[int, int, int], calls: int) -> float:
    """GFLOP/s of `calls` calls of `run` (a gemm_runner of `shape`)."""
    rows, inp, out = shape
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return 2 * rows * inp * out * calls / (time.perf_counter() - start) / 1e9


def gemm_calls(shape: tuple[int, int, int]) -> int:
    """Calls of `shape` in one timing."""
    rows, inp, out = shape
    return max(1, int(2e9 / (2 * rows * inp * out)))  # ~2 GFLOP a timing


def peak_gemm(dtype: torch.dtype, shapes=PEAK_SHAPES, repeats: int = 3) -> tuple[float, tuple[int, int, int]]:
    """The best GFLOP/s of the engine's GEMM for `dtype` weights (gemm_runner) over `shapes`."""
    import torch

    best, best_shape = 0.0, shapes[0]
    with torch.inference_mode():
        for shape in shapes:
            run = gemm_runner(dtype, shape)
            run()
            for _ in range(repeats):
                rate = gemm_rate(run, shape, gemm_calls(shape))
                if rate > best:
                    best, best_shape = rate, shape
    return best, best_shape


def bandwidth_buffer(mib: int) -> torch.Tensor:
    """A `mib` MiB buffer for stream_read, its pages touched."""
    import torch

    from aserve.ops import cpu_kernels

    if not cpu_kernels.available():
        raise RuntimeError("measuring memory bandwidth needs aserve's CPU kernels (ASERVE_CPU_KERNELS is off, or no "
                           "compiler was found)")
    buffer = torch.ones(mib * 2**20 // 8, dtype=torch.int64)
    torch.ops.aserve.stream_read(buffer)
    return buffer


def read_rate(buffer: torch.Tensor) -> float:
    """GB/s of reading `buffer` once (torch.ops.aserve.stream_read, on every thread)."""
    import torch

    start = time.perf_counter()
    torch.ops.aserve.stream_read(buffer)
    return buffer.numel() * 8 / (time.perf_counter() - start) / 1e9


def bandwidth(mib: int = 1024, repeats: int = 5) -> tuple[float, float]:
    """The best and the slowest GB/s of reading a `mib` MiB buffer once, pages touched first."""
    buffer = bandwidth_buffer(mib)
    rates = [read_rate(buffer) for _ in range(repeats)]
    return max(rates), min(rates)


@dataclass
class Probes:
    """The peaks read during the run: before a step, once `interval` seconds have passed since the last reading
    (and before the first step), the best of GEMM_TIMINGS timings of the peak's GEMM shape (~2 GFLOP each) and of
    READS reads of the bandwidth buffer, as the readings before and after the run take the best of theirs (the
    median of single timings taken right after steps read 14% under the rate the run's GEMMs kept, in a 64 x
    128/128 run on an Intel Xeon without AMX tiles). A shared VM's cores and memory change speed within minutes,
    so readings taken only before and after a run can miss the speed it ran at; these say what the machine could
    do while it ran. Their time is kept out of the run's timed wall (`seconds`)."""
    GEMM_TIMINGS = 3
    READS = 2

    interval: float
    gemm: Callable[[], torch.Tensor]  # a gemm_runner of `shape`
    shape: tuple[int, int, int]
    buffer: torch.Tensor
    readings: list = field(default_factory=list)  # (GFLOP/s, GB/s) per probe
    seconds: float = 0.0
    last: float | None = None

    @classmethod
    def make(cls, interval: float, dtype: torch.dtype, shape: tuple[int, int, int], mib: int) -> "Probes":
        import torch

        run = gemm_runner(dtype, shape)
        with torch.inference_mode():
            run()
        return cls(interval, run, shape, bandwidth_buffer(mib))

    def maybe(self) -> None:
        """Probe, if the interval has passed since the last probe (or none was taken)."""
        start = time.perf_counter()
        if self.last is not None and start - self.last < self.interval:
            return
        import torch

        with torch.inference_mode():
            gemm = max(gemm_rate(self.gemm, self.shape, gemm_calls(self.shape)) for _ in range(self.GEMM_TIMINGS))
            self.readings.append((gemm, max(read_rate(self.buffer) for _ in range(self.READS))))
        self.last = time.perf_counter()
        self.seconds += self.last - start

    def medians(self) -> tuple[float, float]:
        """The median GEMM and bandwidth readings (the lower middle of an even count)."""
        gemm, read = (sorted(column) for column in zip(*self.readings))
        middle = (len(gemm) - 1) // 2
        return gemm[middle], read[middle]


def cpu_flags() -> str:
    """The instruction-set flags that decide the kernels' speed, from /proc/cpuinfo (for the report's header)."""
    from aserve.ops.cpu_kernels import _cpu_flags

    have = set(_cpu_flags().split())
    return " ".join(flag for flag in CPU_FLAGS_SHOWN if flag in have) or "none of " + " ".join(CPU_FLAGS_SHOWN)


# -- the model's work -------------------------------------------------------------------------------------------


@dataclass
class ModelCost:
    """What one token costs the model, read off its modules."""
    layer_params: int  # weights every token multiplies by (the decoder layers' linear layers)
    head_params: int  # weights each sampled row multiplies by (the logits projection)
    weight_bytes: int  # every linear weight and the head, as stored (int8 and int4 codes, their scales)
    attention_flops: int  # per (query token, context token): 4 * head_dim * query heads, summed over layers
    kv_bytes: int  # one token's K and V in the cache, all layers
    formats: str  # the decoder layers' weight formats ("unquantized", "int8", ...)
    head_format: str

    @classmethod
    def of(cls, model: torch.nn.Module, kv_cache: torch.Tensor) -> "ModelCost":
        from aserve.attention import Attention
        from aserve.models.layers import Linear
        from aserve.ops.cpu_gemm import PackedLinear, stored_bytes

        def size(module) -> tuple[int, int]:
            params = module.in_features * module.out_features
            if isinstance(module, Linear):
                return params, module.method.weight_bytes(module)
            return params, stored_bytes(module.weight, getattr(module, "packed", None))

        lm_head = getattr(model, "lm_head", None)
        head = getattr(model, "packed_head", None) or lm_head  # a tied head's own copy runs in place of lm_head
        layers = [m for m in model.modules() if isinstance(m, (Linear, PackedLinear)) and m is not head
                  and m is not lm_head]
        formats = sorted({m.method.name for m in layers if isinstance(m, Linear)}) or ["unquantized"]
        layer_params = layer_bytes = 0
        for module in layers:
            params, stored = size(module)
            layer_params, layer_bytes = layer_params + params, layer_bytes + stored
        head_format = head.method.name if isinstance(head, Linear) else "unquantized"
        if head is not None:
            head_params, head_bytes = size(head)
        else:  # a tied head read straight from the embedding
            weight = model.output_weight()
            head_params, head_bytes = weight.numel(), weight.numel() * weight.element_size()
        attention = sum(4 * m.head_dim * m.num_heads for m in model.modules() if isinstance(m, Attention))
        shape = model.shape
        kv_bytes = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * kv_cache.element_size()
        return cls(layer_params, head_params, layer_bytes + head_bytes, attention, kv_bytes, " + ".join(formats),
                   head_format)


def step_bound(step_cost: tuple[float, float, float, float], peaks: Peaks) -> tuple[float, bool]:
    """A step's least possible time: its linear layers, then its attention, one after the other, each bound by
    compute or memory on its own; and whether the linear layers are compute-bound."""
    gemm, weights, attention, kv = step_cost
    flops, bandwidth = peaks.gemm_gflops * 1e9, peaks.bandwidth_gbs * 1e9
    linear_compute, linear_memory = gemm / flops, weights / bandwidth
    return max(linear_compute, linear_memory) + max(attention / flops, kv / bandwidth), linear_compute >= linear_memory


@dataclass
class Work:
    """What the run asked of the machine, summed over its steps, and its least possible time at `peaks`."""
    steps: int = 0
    tokens: int = 0  # tokens through the layers
    sampled_rows: int = 0  # rows through the head
    gemm_flops: float = 0.0
    attention_flops: float = 0.0
    bytes_read: float = 0.0
    step_costs: list = field(default_factory=list)  # per step: GEMM FLOPs, weight bytes, attention FLOPs, K/V bytes
    peaks: Peaks | None = None  # what roofline_seconds and compute_bound_steps hold the run to

    def bound(self, peaks: Peaks) -> tuple[float, int]:
        """The run's least possible time at `peaks`, and how many steps' linear layers are compute-bound there."""
        bounds = [step_bound(cost, peaks) for cost in self.step_costs]
        return sum(seconds for seconds, _ in bounds), sum(compute_bound for _, compute_bound in bounds)

    @property
    def kv_bytes(self) -> float:
        """The K/V the run's attention read (each query's context)."""
        return sum(cost[3] for cost in self.step_costs)

    @property
    def roofline_seconds(self) -> float:
        return self.bound(self.peaks)[0] if self.peaks is not None else 0.0

    @property
    def compute_bound_steps(self) -> int:
        return self.bound(self.peaks)[1] if self.peaks is not None else 0

    def add_step(self, chunks: list[tuple[int, int, bool]], cost: ModelCost) -> None:
        """One step: (context before, new tokens, samples) per request."""
        tokens = sum(n for _, n, _ in chunks)
        rows = sum(samples for _, _, samples in chunks)
        context_pairs = sum(n * c + n * (n + 1) // 2 for c, n, _ in chunks)  # query x key pairs, causal
        gemm = 2.0 * (cost.layer_params * tokens + cost.head_params * rows)
        attention = float(cost.attention_flops * context_pairs)
        kv = float(cost.kv_bytes * sum(c + n for c, n, _ in chunks))
        read = cost.weight_bytes + kv
        self.steps += 1
        self.tokens += tokens
        self.sampled_rows += rows
        self.gemm_flops += gemm
        self.attention_flops += attention
        self.bytes_read += read
        self.step_costs.append((gemm, cost.weight_bytes, attention, kv))


@dataclass
class Run:
    wall: float
    output_tokens: int
    work: Work
    split: dict[str, float] = field(default_factory=dict)  # seconds per GROUPS label, "other ops", "Python ..."
    profiled_wall: float = 0.0
    probes: Probes | None = None  # the peaks read during the timed run, their time out of `wall`


@contextlib.contextmanager
def counting_work(engine, cost: ModelCost, peaks: Peaks | None, probes: Probes | None = None):
    """Count every step the engine's executor runs inside the block into the Work it yields; `probes`, probe
    before the steps as their interval says."""
    work = Work(peaks=peaks)
    executor = engine.executor
    execute = executor.execute

    def counted(sched, *args, **kwargs):
        if probes is not None:
            probes.maybe()
        ids = {request_id for request_id, _ in sched.num_scheduled_tokens}  # none: a step that only frees requests
        chunks = [(req.num_computed_tokens, n, req.num_computed_tokens + n >= req.num_tokens)
                  for req, n in engine.scheduler.scheduled if req.request_id in ids]
        if chunks and sched.num_steps > 1:  # multi-step decoding: a forward a step, each a token a request
            for i in range(sched.num_steps):
                work.add_step([(context + i, 1, True) for context, _, _ in chunks], cost)
        elif chunks:
            work.add_step(chunks, cost)
        return execute(sched, *args, **kwargs)

    executor.execute = counted  # an instance attribute over the class's method, deleted after
    try:
        yield work
    finally:
        del executor.execute


def split_by_profile(llm, requests, params) -> tuple[float, dict[str, float]]:
    """Run the workload under torch.profiler; its wall time and seconds per GROUPS label, other ops, and Python and
    scheduling (wall minus every op's self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(requests, params, use_tqdm=False)
        wall = time.perf_counter() - start
    split = {label: 0.0 for label, _ in GROUPS} | {"other ops": 0.0}
    for event in prof.key_averages():
        name = event.key.lower()
        label = next((label for label, keys in GROUPS if any(k in name for k in keys)), "other ops")
        split[label] += event.self_cpu_time_total / 1e6
    split["Python and scheduling"] = max(0.0, wall - sum(split.values()))
    return wall, split


def measure(llm, prompts: list[list[int]], params, peaks: Peaks | None,
            profiled_prompts: list[list[int]] | None = None, probes: Probes | None = None) -> Run:
    """The workload timed with its work counted (and `probes` taken between its steps, their time not counted),
    then, given `profiled_prompts` (others than `prompts`, so that the prefix cache holds none of them), that one
    under the profiler. The first prompt's first tokens, reversed, warm the engine up."""
    engine = llm.engine
    runner = engine.executor.worker.runner
    cost = ModelCost.of(runner.model, runner.kv_cache)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate([{"prompt_token_ids": prompts[0][:16][::-1]}], params.clone(max_tokens=4), use_tqdm=False)
    with counting_work(engine, cost, peaks, probes) as work:
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        wall = time.perf_counter() - start - (probes.seconds if probes is not None else 0.0)
    run = Run(wall, sum(len(o.token_ids) for out in outputs for o in out.outputs), work, probes=probes)
    if profiled_prompts:
        run.profiled_wall, run.split = split_by_profile(llm, [{"prompt_token_ids": p} for p in profiled_prompts],
                                                        params)
    return run


# -- the report -------------------------------------------------------------------------------------------------


def gemm_ceiling(run: Run, gemm_gflops: float) -> float:
    """The fraction of `gemm_gflops` the run would reach with every GEMM at that rate and everything else taking the
    share of the time it took under the profiler (attention, other ops, Python), scaled to the timed wall: what the
    time outside the GEMMs leaves within reach, whatever the GEMMs do."""
    at_peak = run.work.gemm_flops / gemm_gflops / 1e9
    rest = (1.0 - run.split["GEMM"] / run.profiled_wall) * run.wall
    return at_peak / (at_peak + max(rest, 0.0))


def attention_ceiling(run: Run, gemm_gflops: float, bandwidth_gbs: float) -> float:
    """gemm_ceiling with attention at its floor too: every GEMM at `gemm_gflops`, attention taking the time its K/V
    take to read at `bandwidth_gbs` (or the share it took, where that was less: K/V found in the caches), and other
    ops and Python the share of the time they took. Where the first ceiling is attention's, this one says how much
    of it the K/V's bytes alone leave within reach."""
    at_peak = run.work.gemm_flops / gemm_gflops / 1e9
    took = run.split["attention"] / run.profiled_wall * run.wall
    floor = min(run.work.kv_bytes / bandwidth_gbs / 1e9, took)
    rest = (1.0 - (run.split["GEMM"] + run.split["attention"]) / run.profiled_wall) * run.wall
    return at_peak / (at_peak + floor + max(rest, 0.0))


def report(run: Run, peaks: Peaks) -> None:
    w = run.work
    gemm_speed = w.gemm_flops / run.wall / 1e9
    read_speed = w.bytes_read / run.wall / 1e9
    print(f"{run.output_tokens} output tokens in {run.wall:.2f} s: {run.output_tokens / run.wall:.2f} output tokens/s, "
          f"{w.steps} steps, {w.tokens} tokens through the layers, {w.sampled_rows} rows through the head")
    print(f"GEMM: {w.gemm_flops / 1e9:.1f} GFLOP, {gemm_speed:.0f} GFLOP/s over the whole run = "
          f"{gemm_speed / peaks.gemm_gflops:.0%} of the peak; attention {w.attention_flops / 1e9:.1f} GFLOP")
    print(f"memory: {w.bytes_read / 1e9:.2f} GB read (weights once a step, K/V per query), {read_speed:.1f} GB/s = "
          f"{read_speed / peaks.bandwidth_gbs:.0%} of the bandwidth")
    seconds, compute_bound = w.bound(peaks)
    print(f"roofline: at least {seconds:.2f} s at these peaks ({compute_bound} of {w.steps} steps' "
          f"linear layers compute-bound): this run reached {seconds / run.wall:.0%} of the machine's limit")
    probes = run.probes if run.probes is not None and run.probes.readings else None
    if probes is not None:
        gemm_median, read_median = probes.medians()
        gemms, reads = zip(*probes.readings)
        at_medians = w.bound(dataclasses.replace(peaks, gemm_gflops=gemm_median, bandwidth_gbs=read_median))[0]
        print(f"peaks read during the run ({len(probes.readings)} probes, {probes.seconds:.2f} s kept out of the "
              f"timing): GEMM median {gemm_median:.0f} GFLOP/s ({min(gemms):.0f}-{max(gemms):.0f}), bandwidth median "
              f"{read_median:.1f} GB/s ({min(reads):.1f}-{max(reads):.1f}); against the medians: GEMM "
              f"{gemm_speed / gemm_median:.0%} of the peak, memory {read_speed / read_median:.0%} of the bandwidth, "
              f"{at_medians / run.wall:.0%} of the limit")
    if run.split:
        print(f"where the time went (the same workload under torch.profiler, {run.profiled_wall:.2f} s):")
        print("| where | s | share |\n| --- | ---: | ---: |")
        for label, seconds in run.split.items():
            print(f"| {label} | {seconds:.2f} | {seconds / run.profiled_wall:.0%} |")
        gemm = run.split.get("GEMM", 0.0)
        if gemm:
            inside = w.gemm_flops / gemm / 1e9
            median = f" ({inside / gemm_median:.0%} of the probes' median)" if probes is not None else ""
            print(f"inside the GEMMs: {inside:.0f} GFLOP/s = {inside / peaks.gemm_gflops:.0%} of the peak{median}")
            rest = ", ".join(f"{label} {seconds / run.profiled_wall:.0%}" for label, seconds in run.split.items()
                             if label != "GEMM")
            median = f" ({gemm_ceiling(run, gemm_median):.0%} of the probes' median)" if probes is not None else ""
            print(f"outside the GEMMs ({rest} of the time): with every GEMM at the peak, the run would reach "
                  f"{gemm_ceiling(run, peaks.gemm_gflops):.0%} of the peak{median}")
        attention = run.split.get("attention", 0.0)
        if gemm and attention and w.kv_bytes:
            rate = w.kv_bytes / attention / 1e9
            print(f"inside attention: {w.kv_bytes / 1e9:.2f} GB of K/V at {rate:.1f} GB/s = "
                  f"{rate / peaks.bandwidth_gbs:.0%} of the bandwidth (its KV writes and prefill in its time); with "
                  f"every GEMM at the peak and attention reading its K/V at the bandwidth, the run would reach "
                  f"{attention_ceiling(run, peaks.gemm_gflops, peaks.bandwidth_gbs):.0%} of the peak")


def main(args: argparse.Namespace) -> None:
    options = engine_options(args)
    if options.get("tensor_parallel_size", 1) > 1 or options.get("pipeline_parallel_size", 1) > 1 \
            or options.get("data_parallel_size", 1) > 1:
        raise SystemExit("aserve bench roofline: measures one process (no tensor, pipeline or data parallelism)")
    if options.get("speculative_config"):
        raise SystemExit("aserve bench roofline: counts plain decoding (no speculative_config)")
    EngineConfig.from_kwargs(**options).verify()  # a wrong folder or policy: an error before torch loads
    from aserve import LLM, SamplingParams
    from aserve.bench.throughput import random_prompts, report as throughput_line
    from aserve.hardware import cpu_info
    llm = LLM(**options)
    engine = llm.engine
    dtype = engine.dtype
    runner = engine.executor.worker.runner
    cost = ModelCost.of(runner.model, runner.kv_cache)
    print(f"aserve bench roofline: {cpu_info().describe()} (flags: {cpu_flags()}), dtype "
          f"{str(dtype).replace('torch.', '')}, weights {cost.formats}, head {cost.head_format} "
          f"({cost.weight_bytes / 1e6:.1f} MB read a step), KV cache {runner.kv_cache_dtype}", flush=True)
    gflops, shape = peak_gemm(dtype)
    peaks = Peaks(gflops, shape, *bandwidth(args.bandwidth_mib))
    print(f"peak GEMM: {peaks.gemm_gflops:.0f} GFLOP/s ({str(dtype).replace('torch.', '')}, best of "
          f"{' '.join('x'.join(map(str, s)) for s in PEAK_SHAPES)} rows x in x out)", flush=True)
    print(f"memory bandwidth: {peaks.bandwidth_gbs:.1f} GB/s (a {args.bandwidth_mib} MiB buffer read once, best of 5; "
          f"the slowest {peaks.bandwidth_slowest_gbs:.1f})", flush=True)
    avoid = set(engine.eos_token_ids) | set(engine.tokenizer.all_special_ids)
    prompts, profiled = (random_prompts(args.num_prompts, args.input_len, engine.vocab_size, avoid, seed)
                         for seed in (args.seed, args.seed + 1))
    params = SamplingParams(**sampling_options(args), ignore_eos=True, max_tokens=args.output_len)
    probes = Probes.make(args.probe_interval, dtype, peaks.gemm_shape, args.bandwidth_mib) if args.probe_interval > 0 \
        else None
    run = measure(llm, prompts, params, None, None if args.no_profile else profiled, probes)
    # A shared VM's memory and cores can change speed within minutes: both peaks are measured again after the
    # workload, and the higher of the two readings is the one the run is held to (a fraction never flatters it; a
    # peak read in a slow minute put runs at over 100% of it).
    after_gflops, after_shape = peak_gemm(dtype)
    gflops, shape = max((peaks.gemm_gflops, peaks.gemm_shape), (after_gflops, after_shape))
    print(f"peak GEMM after the run: {after_gflops:.0f} GFLOP/s; the fractions below use {gflops:.0f}", flush=True)
    after, after_slowest = bandwidth(args.bandwidth_mib)
    print(f"memory bandwidth after the run: {after:.1f} GB/s (best of 5; the slowest {after_slowest:.1f}); the "
          f"fractions below use {max(after, peaks.bandwidth_gbs):.1f}", flush=True)
    peaks = dataclasses.replace(peaks, gemm_gflops=gflops, gemm_shape=shape,
                                bandwidth_gbs=max(after, peaks.bandwidth_gbs),
                                bandwidth_slowest_gbs=min(after_slowest, peaks.bandwidth_slowest_gbs))
    print(f"workload: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out")
    report(run, peaks)
    throughput_line("", len(prompts), sum(map(len, prompts)) + run.output_tokens, run.output_tokens, run.wall)
