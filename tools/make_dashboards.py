#!/usr/bin/env python3
"""Write grafana/overview.json and grafana/scheduler.json from the panel lists below.

Every query filters on `$model_name` and runs against the `${datasource}` variable; averages are
rate(sum) / rate(count). Engine metrics carry a `replica` label (data parallelism; "0" with one replica):
rates and histograms sum over it, gauges are summed (request counts) or averaged (usage fractions), and
the panels "by replica" keep it. tests/test_metrics.py checks each metric named here against the live registry
and, with a real Prometheus, that every query returns data.
"""
import json
from pathlib import Path

M = '{model_name="$model_name"}'
R = "[$__rate_interval]"


def rate(metric: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping}(rate({metric}{M}{R}))"


def total(metric: str, how: str = "sum") -> str:
    """A gauge over every replica: summed (request counts) or averaged (usage fractions)."""
    return f"{how}({metric}{M})"


def per_replica(metric: str) -> str:
    return f"sum by (replica) ({metric}{M})"


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    extra = f", {by}" if by else ""
    legend = f"{{{{{by}}}}} " if by else ""
    targets = [(f"histogram_quantile({q}, sum by (le{extra}) (rate({metric}_bucket{M}{R})))", f"{legend}p{int(q * 100)}")
               for q in (0.5, 0.9, 0.99)]
    targets.append((f"{rate(metric + '_sum', by)} / {rate(metric + '_count', by)}", f"{legend}mean"))
    return targets


OVERVIEW = [
    ("Request rate by finish reason (req/s)", "Finished requests per second, split by why they ended.",
     [(rate("aserve:request_success_total", "finished_reason"), "{{finished_reason}}")], "reqps"),
    ("Token throughput (tokens/s)", "Prompt tokens prefilled and tokens generated per second.",
     [(rate("aserve:prompt_tokens_total"), "prompt"), (rate("aserve:generation_tokens_total"), "generation")],
     "short"),
    ("Time to first token (s)", "p50/p90/p99 and mean time from arrival to the first token.",
     quantiles("aserve:time_to_first_token_seconds"), "s"),
    ("Inter-token latency (s)", "p50/p90/p99 and mean time between consecutive tokens of a request.",
     quantiles("aserve:inter_token_latency_seconds"), "s"),
    ("End-to-end latency (s)", "p50/p90/p99 and mean time from arrival to the last token.",
     quantiles("aserve:e2e_request_latency_seconds"), "s"),
    ("Scheduler state (requests)", "Requests running in the batch, waiting for admission, and swapped out "
     "(all replicas).",
     [(total("aserve:num_requests_running"), "running"), (total("aserve:num_requests_waiting"), "waiting"),
      (total("aserve:num_requests_swapped"), "swapped")], "short"),
    ("KV cache usage", "Share of device KV blocks in use, and of the host swap pool (mean over replicas).",
     [(total("aserve:kv_cache_usage_perc", "avg"), "device"), (total("aserve:cpu_cache_usage_perc", "avg"), "host")],
     "percentunit"),
    ("Prefix cache hit rate", "Share of prompt tokens found in the prefix cache.",
     [(f"{rate('aserve:prefix_cache_hits_total')} / {rate('aserve:prefix_cache_queries_total')}", "hit rate")],
     "percentunit"),
    ("Queue, prefill and decode time (mean, s)", "Where a request's time goes: waiting, prefill, decode.",
     [(f"{rate(f'aserve:request_{p}_time_seconds_sum')} / {rate(f'aserve:request_{p}_time_seconds_count')}", p)
      for p in ("queue", "prefill", "decode")], "s"),
    ("Request lengths (mean tokens)", "Mean prompt and output length of finished requests.",
     [(f"{rate('aserve:request_prompt_tokens_sum')} / {rate('aserve:request_prompt_tokens_count')}", "prompt"),
      (f"{rate('aserve:request_generation_tokens_sum')} / {rate('aserve:request_generation_tokens_count')}",
       "generation")], "short"),
    ("Tokens per engine step (mean)", "How full each batch is: scheduled tokens per step.",
     [(f"{rate('aserve:iteration_tokens_total_sum')} / {rate('aserve:iteration_tokens_total_count')}", "tokens")],
     "short"),
    ("Structured output requests by kind (req/s)", "New requests constrained by a JSON schema, JSON object, "
     "regex, choice or grammar (tool calls with required or named choice count as json).",
     [(rate("aserve:structured_output_requests_total", "kind"), "{{kind}}")], "reqps"),
    ("Grammar compile time (s)", "p50/p90/p99 and mean time to compile a grammar (cache misses only).",
     quantiles("aserve:grammar_compile_seconds"), "s"),
]

SCHEDULER = [
    ("Preemptions by mode (/s)", "How often blocks ran out, by what was done: recompute or swap.",
     [(rate("aserve:num_preemptions_total", "mode"), "{{mode}}")], "short"),
    ("Swap traffic (blocks/s)", "KV blocks copied to (out) and back from (in) the host swap pool.",
     [(rate("aserve:swapped_blocks_total", "direction"), "{{direction}}")], "short"),
    ("Recomputed tokens (/s)", "Computed tokens thrown away by recompute preemption.",
     [(rate("aserve:recomputed_tokens_total"), "recomputed")], "short"),
    ("Time to first token by priority (s)", "Per priority class (with the priority policy): p50/p90/p99, mean.",
     quantiles("aserve:time_to_first_token_seconds", "priority"), "s"),
    ("End-to-end latency by priority (s)", "Per priority class: p50/p90/p99 and mean.",
     quantiles("aserve:e2e_request_latency_seconds", "priority"), "s"),
    ("Queue time by priority (mean, s)", "How long each priority class waits for admission.",
     [(f"{rate('aserve:request_queue_time_seconds_sum', 'priority')} / "
       f"{rate('aserve:request_queue_time_seconds_count', 'priority')}", "{{priority}}")], "s"),
    ("Waiting and swapped requests", "The queues the policy orders (all replicas).",
     [(total("aserve:num_requests_waiting"), "waiting"), (total("aserve:num_requests_swapped"), "swapped")], "short"),
    ("Device and host KV usage by replica", "Memory pressure that triggers preemption, and room left for swapping.",
     [(per_replica("aserve:kv_cache_usage_perc"), "device {{replica}}"),
      (per_replica("aserve:cpu_cache_usage_perc"), "host {{replica}}")], "percentunit"),
    ("Requests by replica", "Running and waiting requests on each data-parallel replica: how evenly the router "
     "spreads the load.",
     [(per_replica("aserve:num_requests_running"), "running {{replica}}"),
      (per_replica("aserve:num_requests_waiting"), "waiting {{replica}}")], "short"),
    ("Replicas up", "Data-parallel replicas whose engine core is alive (the server exits when none is).",
     [(total("aserve:replica_up"), "up"), (f"count(aserve:replica_up{M})", "replicas")], "short"),
    ("Policy", "The scheduling policy, block size and the device and host block counts.",
     [(f"aserve:policy_info{M}", "{{policy}} block={{block_size}} device={{num_device_blocks}} "
                                 "host={{num_host_blocks}}")], "short"),
]


def panel(i: int, title: str, description: str, targets, unit: str) -> dict:
    return {
        "id": i + 1, "type": "timeseries", "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for j, (expr, legend) in enumerate(targets)],
    }


def dashboard(uid: str, title: str, panels) -> dict:
    return {
        "uid": uid, "title": title, "tags": ["aserve"], "timezone": "browser", "schemaVersion": 39, "version": 1,
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "model_name", "label": "Model", "type": "query",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(aserve:num_requests_running, model_name)", "refId": "model_name"},
             "definition": "label_values(aserve:num_requests_running, model_name)", "refresh": 2, "current": {},
             "hide": 0},
        ]},
        "panels": [panel(i, *p) for i, p in enumerate(panels)],
    }


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "grafana"
    out.mkdir(exist_ok=True)
    for name, uid, title, panels in (("overview", "aserve-overview", "aserve: overview", OVERVIEW),
                                     ("scheduler", "aserve-scheduler", "aserve: scheduler", SCHEDULER)):
        (out / f"{name}.json").write_text(json.dumps(dashboard(uid, title, panels), indent=2) + "\n")
        print(f"wrote grafana/{name}.json: {len(panels)} panels")


if __name__ == "__main__":
    main()
