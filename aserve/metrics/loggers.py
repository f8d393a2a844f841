"""Stat loggers: Prometheus collectors named like vLLM's (prefix `aserve:`, labels `model_name` and
`replica`), and a periodic log line. Both are fed the IterationStats the engine core hands out after its steps.

Every engine metric carries the data-parallel replica it comes from (`replica="0"` with one), so a query that
wants the engine as a whole sums (or averages, for the usage fractions) over it; `policy_info` describes the
model's configuration and has no replica. `replica_up` says which replicas' cores are alive."""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from aserve.metrics.stats import IterationStats
from aserve.structured_output.params import KINDS

log = logging.getLogger("aserve")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
COMPILE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def buckets_1_2_5(limit: int) -> list[int]:
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class PrometheusStatLogger:
    """The engine's metrics in a registry of their own (several engines may share a process)."""

    def __init__(self, model_name: str, *, max_model_len: int, policy: str, block_size: int, num_blocks: int,
                 num_host_blocks: int, priority_classes: bool = False, registry: CollectorRegistry | None = None,
                 kv_cache_dtype: str = "", num_replicas: int = 1):
        self.registry = registry or CollectorRegistry()
        self.labels = {"model_name": model_name}
        self.replica_labels = [{"model_name": model_name, "replica": str(i)} for i in range(num_replicas)]
        self.replica_values = [(model_name, str(i)) for i in range(num_replicas)]
        self._children: dict[tuple, object] = {}  # see _series
        self._gauges_set: list[dict[int, float]] = [{} for _ in range(num_replicas)]  # see record
        self.priority_classes = priority_classes
        base = ["model_name", "replica"]
        latency_labels = base + (["priority"] if priority_classes else [])
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"aserve:{name}", doc, base, registry=r)

        def counter(name, doc, extra=()):
            return Counter(f"aserve:{name}", doc, base + list(extra), registry=r)

        def histogram(name, doc, buckets, labels=base):
            return Histogram(f"aserve:{name}", doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted.")
        self.swapped = gauge("num_requests_swapped", "Requests whose KV blocks are in the host swap pool.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use (1 = full).")
        self.cpu_usage = gauge("cpu_cache_usage_perc", "Fraction of host swap-pool blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.preemptions = counter("num_preemptions", "Preemptions by mode (recompute or swap).", ["mode"])
        self.swapped_blocks = counter("swapped_blocks", "KV blocks copied to (out) or from (in) the host pool.",
                                      ["direction"])
        self.recomputed = counter("recomputed_tokens", "Computed tokens dropped by recompute preemption.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS, latency_labels)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             ITL_BUCKETS, latency_labels)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS, latency_labels)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS,
                               latency_labels)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS,
                                 latency_labels)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS,
                                latency_labels)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                    buckets_1_2_5(max_model_len))
        self.generation_len = histogram("request_generation_tokens", "Output length of finished requests.",
                                        buckets_1_2_5(max_model_len))
        self.iteration = histogram("iteration_tokens_total", "Tokens batched per engine step.", ITERATION_BUCKETS)
        self.structured = counter("structured_output_requests", "Requests with structured output, by kind "
                                  "(json, json_object, regex, choice, grammar).", ["kind"])
        self.beam_requests = counter("beam_search_requests", "Beam-search requests admitted (each runs its beam_width "
                                     "beams as one request).")
        # speculative decoding, with vLLM's names (under aserve:)
        self.spec_drafts = counter("spec_decode_num_drafts", "Times a request checked proposals in a step.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens checked.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, "
                                             "by position in the proposal (0 = the first).", ["position"])
        self.compile_time = histogram("grammar_compile_seconds", "Time to compile a structured-output grammar "
                                      "(cache misses only), on the engine core's compile thread.", COMPILE_BUCKETS)
        self.up = gauge("replica_up", "1 while the replica's engine core is alive, 0 once it has died.")
        # LoRA, as vLLM reports it: one series whose labels name the adapters in use (its value: when, in seconds)
        self.lora_info = Gauge("aserve:lora_requests_info", "Running and waiting LoRA adapters (comma-separated "
                               "names) and max_lora; the value is the time of the last update.",
                               base + ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        self.lora_requests = counter("lora_requests", "Finished requests by LoRA adapter (the base model's have "
                                     "none and are not counted here).", ["lora_name"])
        self._lora_series: dict[int, tuple] = {}  # replica -> its current lora_requests_info labels
        info = Info("aserve:policy", "The scheduling policy and the KV cache it manages (per replica).", ["model_name"],
                    registry=r)
        info.labels(**self.labels).info({"policy": policy, "block_size": str(block_size),
                                         "num_device_blocks": str(num_blocks),
                                         "num_host_blocks": str(num_host_blocks),
                                         "kv_cache_dtype": kv_cache_dtype, "data_parallel_size": str(num_replicas)})
        # the scheduler's counters are totals since start: remember what was already counted, per replica
        self._seen = [{"recompute": 0, "swap": 0, "out": 0, "in": 0, "recomputed": 0, "queries": 0, "hits": 0}
                      for _ in range(num_replicas)]
        for labels in self.replica_labels:  # every series exists (at 0) from the start
            for g in (self.running, self.waiting, self.swapped, self.kv_usage, self.cpu_usage):
                g.labels(**labels)
            self.up.labels(**labels).set(1)
            for reason in ("stop", "length", "abort"):
                self.success.labels(**labels, finished_reason=reason)
            for mode in ("recompute", "swap"):
                self.preemptions.labels(**labels, mode=mode)
            for kind in KINDS:
                self.structured.labels(**labels, kind=kind)
            self.compile_time.labels(**labels)
            self.beam_requests.labels(**labels)
            for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.recomputed,
                      self.prefix_queries, self.prefix_hits):
                c.labels(**labels)
            for direction in ("in", "out"):
                self.swapped_blocks.labels(**labels, direction=direction)

    def _series(self, metric, replica: int, *values: str):
        """metric's child for the replica and the further label values, looked up once: prometheus_client's
        labels() validates and locks on every call, and record() took ~70 us a step (1% of a batch-1 decode)."""
        key = (id(metric), replica, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*self.replica_values[replica], *values)
        return child

    def _latency(self, histogram: Histogram, replica: int, priority: int):
        if self.priority_classes:
            return self._series(histogram, replica, str(priority))
        return self._series(histogram, replica)

    def _advance(self, replica: int, counter, values: tuple, key: str, total: int) -> None:
        seen = self._seen[replica]
        if total > seen[key]:  # the series exists (at 0) from the start
            self._series(counter, replica, *values).inc(total - seen[key])
            seen[key] = total

    def replica_died(self, replica: int) -> None:
        """Its core is gone: `replica_up` 0, and its queues and cache usage 0 (its requests went with it)."""
        labels = self.replica_labels[replica]
        self.up.labels(**labels).set(0)
        for g in (self.running, self.waiting, self.swapped, self.kv_usage, self.cpu_usage):
            g.labels(**labels).set(0)
        self._gauges_set[replica].clear()

    def record(self, stats: IterationStats, replica: int = 0) -> None:
        series = self._series
        s = stats.scheduler
        if s is not None:
            # A gauge is set when its value changes: in a step after the caches streamed the weights each set()
            # is several cold reads (the child, its lock, its value), and from one step to the next these stay.
            last = self._gauges_set[replica]
            for gauge, value in ((self.running, s.num_running), (self.waiting, s.num_waiting),
                                 (self.swapped, s.num_swapped), (self.kv_usage, s.kv_cache_usage),
                                 (self.cpu_usage, s.host_cache_usage)):
                if last.get(id(gauge)) != value:
                    series(gauge, replica).set(value)
                    last[id(gauge)] = value
            for mode in ("recompute", "swap"):
                self._advance(replica, self.preemptions, (mode,), mode, s.preemptions.get(mode, 0))
            self._advance(replica, self.swapped_blocks, ("out",), "out", s.blocks_swapped_out)
            self._advance(replica, self.swapped_blocks, ("in",), "in", s.blocks_swapped_in)
            self._advance(replica, self.recomputed, (), "recomputed", s.recomputed_tokens)
            self._advance(replica, self.prefix_queries, (), "queries", s.prefix_queries)
            self._advance(replica, self.prefix_hits, (), "hits", s.prefix_hits)
            if s.max_loras:
                self._record_loras(replica, self.replica_labels[replica], s)
        if stats.prompt_tokens:
            series(self.prompt_tokens, replica).inc(stats.prompt_tokens)
        if stats.generation_tokens:
            series(self.generation_tokens, replica).inc(stats.generation_tokens)
        for tokens in stats.iteration_tokens:
            series(self.iteration, replica).observe(tokens)
        for priority, seconds in stats.time_to_first_token:
            self._latency(self.ttft, replica, priority).observe(seconds)
        for priority, seconds in stats.inter_token_latency:
            self._latency(self.itl, replica, priority).observe(seconds)
        for kind in stats.structured_requests:
            series(self.structured, replica, kind).inc()
        for seconds in stats.grammar_compile_seconds:
            series(self.compile_time, replica).observe(seconds)
        if stats.beam_requests:
            series(self.beam_requests, replica).inc(stats.beam_requests)
        if stats.spec_drafts:
            series(self.spec_drafts, replica).inc(stats.spec_drafts)
            series(self.spec_draft_tokens, replica).inc(stats.spec_draft_tokens)
            series(self.spec_accepted, replica).inc(stats.spec_accepted_tokens)
            for position, count in enumerate(stats.spec_accepted_per_pos):
                series(self.spec_accepted_per_pos, replica, str(position)).inc(count)
        for f in stats.finished:
            series(self.success, replica, f.finish_reason).inc()
            self._latency(self.e2e, replica, f.priority).observe(f.e2e_latency)
            self._latency(self.queue, replica, f.priority).observe(f.queue_time)
            self._latency(self.prefill, replica, f.priority).observe(f.prefill_time)
            self._latency(self.decode, replica, f.priority).observe(f.decode_time)
            series(self.prompt_len, replica).observe(f.prompt_tokens)
            series(self.generation_len, replica).observe(f.generation_tokens)
            if f.lora_name is not None:
                series(self.lora_requests, replica, f.lora_name).inc()

    def _record_loras(self, replica: int, labels: dict, s) -> None:
        """One lora_requests_info series per replica: the previous one goes when the adapters in use change."""
        series = (labels["model_name"], labels["replica"], ",".join(s.running_loras), ",".join(s.waiting_loras),
                  str(s.max_loras))
        previous = self._lora_series.get(replica)
        if previous is not None and previous != series:
            self.lora_info.remove(*previous)
        self._lora_series[replica] = series
        self.lora_info.labels(*series).set(time.time())

    def samples(self) -> list[tuple[str, dict, float]]:
        """Every sample in the registry as (name, labels, value): what get_metrics() returns."""
        return [(s.name, dict(s.labels), s.value) for family in self.registry.collect() for s in family.samples]


class LoggingStatLogger:
    """A line every `interval` seconds: throughput, queues, KV usage and prefix-cache hit rate."""

    def __init__(self, interval: float = 10.0, prefix: str = ""):
        self.interval = interval
        self.prefix = prefix  # "replica 1: " with several data-parallel replicas, each with its own line
        self.last = time.monotonic()
        self.prompt_tokens = self.generation_tokens = 0
        self.last_queries = self.last_hits = 0
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0

    def record(self, stats: IterationStats) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.generation_tokens += stats.generation_tokens
        self.spec_drafts += stats.spec_drafts
        self.spec_draft_tokens += stats.spec_draft_tokens
        self.spec_accepted += stats.spec_accepted_tokens
        now = time.monotonic()
        s = stats.scheduler
        if s is None or now - self.last < self.interval:
            return
        elapsed, self.last = now - self.last, now
        queries, hits = s.prefix_queries - self.last_queries, s.prefix_hits - self.last_hits
        self.last_queries, self.last_hits = s.prefix_queries, s.prefix_hits
        log.info("%sprompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, "
                 "waiting: %d, swapped: %d, KV cache usage: %.1f%%, host cache usage: %.1f%%, "
                 "prefix cache hit rate: %.1f%%", self.prefix, self.prompt_tokens / elapsed,
                 self.generation_tokens / elapsed,
                 s.num_running, s.num_waiting, s.num_swapped, 100 * s.kv_cache_usage, 100 * s.host_cache_usage,
                 100 * hits / queries if queries else 0.0)
        if self.spec_drafts:  # vLLM's: tokens a request gained per checking step, proposals accepted + its own
            log.info("%sspeculative decoding: mean acceptance length %.2f, accepted %d of %d proposed tokens "
                     "(%.1f%%)", self.prefix, 1 + self.spec_accepted / self.spec_drafts, self.spec_accepted,
                     self.spec_draft_tokens, 100 * self.spec_accepted / max(1, self.spec_draft_tokens))
        self.prompt_tokens = self.generation_tokens = 0
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0


class StatLoggers:
    """The loggers an engine front end (LLM or AsyncLLM) feeds, with the replica each stats object comes from."""

    def __init__(self, model_name: str, facts, policy_name: str, priority_classes: bool, log_stats: bool,
                 log_interval: float = 10.0, num_replicas: int = 1):
        self.prometheus = PrometheusStatLogger(
            model_name, max_model_len=facts.max_model_len, policy=policy_name, block_size=facts.block_size,
            num_blocks=facts.num_blocks, num_host_blocks=facts.num_host_blocks, priority_classes=priority_classes,
            kv_cache_dtype=facts.kv_cache_dtype, num_replicas=num_replicas)
        self.logging = ([LoggingStatLogger(log_interval, f"replica {i}: " if num_replicas > 1 else "")
                         for i in range(num_replicas)] if log_stats else [])

    def record(self, stats: IterationStats, replica: int = 0) -> None:
        self.prometheus.record(stats, replica)
        if self.logging:
            self.logging[replica].record(stats)

    def replica_died(self, replica: int) -> None:
        self.prometheus.replica_died(replica)
