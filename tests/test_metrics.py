"""Metrics: exact counts after known work, preempted/swapped/aborted requests where they belong, dashboards
that name only live metrics, and (with Debian's prometheus installed) every dashboard query answered."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import httpx
import pytest

from aserve import LLM, SamplingParams
from conftest import kv_memory_for_blocks, random_prompts, wait_for
from server_util import RunningServer, free_port

GRAFANA = Path(__file__).parent.parent / "grafana"
LENGTHS = [7, 12, 20, 33, 41]
OUT = 10
FAMILY = "llama-untied"


def value(samples, name, **labels):
    matches = [v for n, lab, v in samples if n == name and all(lab.get(k) == str(x) for k, x in labels.items())]
    assert matches, f"no sample {name} {labels}"
    return sum(matches)


def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(len(LENGTHS), seed=41, lengths=(1, 1))]


def known_prompts():
    base = random_prompts(1, lengths=(60, 60), seed=42)[0]
    return [{"prompt_token_ids": [t + i for t in base[:n]]} for i, n in enumerate(LENGTHS)]  # no shared prefix


def test_exact_counts_after_known_work(model_dirs):
    llm = LLM(str(model_dirs[FAMILY]), dtype="float32", kv_cache_memory="32MiB", served_model_name="tiny")
    llm.generate(known_prompts(), SamplingParams(max_tokens=OUT, ignore_eos=True), use_tqdm=False)
    s = llm.get_metrics()
    n, total_prompt = len(LENGTHS), sum(LENGTHS)
    assert value(s, "aserve:prompt_tokens_total", model_name="tiny") == total_prompt
    assert value(s, "aserve:generation_tokens_total") == n * OUT
    assert value(s, "aserve:request_success_total", finished_reason="length") == n
    assert value(s, "aserve:request_success_total", finished_reason="stop") == 0
    assert value(s, "aserve:request_prompt_tokens_count") == n
    assert value(s, "aserve:request_prompt_tokens_sum") == total_prompt
    assert value(s, "aserve:request_generation_tokens_sum") == n * OUT
    assert value(s, "aserve:time_to_first_token_seconds_count") == n
    assert value(s, "aserve:inter_token_latency_seconds_count") == n * (OUT - 1)
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert value(s, f"aserve:{name}_seconds_count") == n
    e2e = value(s, "aserve:e2e_request_latency_seconds_sum")
    parts = sum(value(s, f"aserve:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert abs(e2e - parts) < 1e-6  # the phases add up to the whole
    # every prompt token once, then one token per decode step
    assert value(s, "aserve:iteration_tokens_total_sum") == total_prompt + n * (OUT - 1)
    assert value(s, "aserve:prefix_cache_queries_total") == total_prompt
    assert value(s, "aserve:prefix_cache_hits_total") == 0
    assert value(s, "aserve:num_preemptions_total", mode="recompute") == 0
    assert value(s, "aserve:num_requests_running") == 0 and value(s, "aserve:kv_cache_usage_perc") == 0
    info = [lab for name, lab, _ in s if name == "aserve:policy_info"][0]
    assert info["policy"] == "fcfs" and info["block_size"] == "16" and int(info["num_device_blocks"]) > 0


@pytest.mark.parametrize("policy, mode", [("fcfs", "recompute"), ("fcfs-swap", "swap")])
def test_preempted_and_swapped_requests_are_counted(model_dirs, policy, mode):
    path = model_dirs[FAMILY]
    llm = LLM(str(path), dtype="float32", policy=policy, kv_cache_memory=kv_memory_for_blocks(path, 6),
              swap_space=str(kv_memory_for_blocks(path, 20)))
    llm.generate(known_prompts(), SamplingParams(max_tokens=OUT, ignore_eos=True), use_tqdm=False)
    s, sched = llm.get_metrics(), llm.engine.scheduler.stats()
    assert value(s, "aserve:num_preemptions_total", mode=mode) == sched.preemptions[mode] > 0
    assert value(s, "aserve:prompt_tokens_total") == sum(LENGTHS)  # counted once, however often recomputed
    assert value(s, "aserve:generation_tokens_total") == len(LENGTHS) * OUT
    assert value(s, "aserve:recomputed_tokens_total") == sched.recomputed_tokens
    out, back = (value(s, "aserve:swapped_blocks_total", direction=d) for d in ("out", "in"))
    assert out == back == sched.blocks_swapped_out
    assert (out > 0) == (mode == "swap")


def test_aborted_requests_are_counted(model_dirs):
    llm = LLM(str(model_dirs[FAMILY]), dtype="float32", kv_cache_memory="16MiB")
    engine = llm.engine
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50), request_id="gone")
    engine.step()
    engine.step()
    engine.abort("gone")
    llm.stats.record(engine.take_stats())
    s = llm.get_metrics()
    assert value(s, "aserve:request_success_total", finished_reason="abort") == 1
    assert value(s, "aserve:e2e_request_latency_seconds_count") == 1
    assert value(s, "aserve:request_generation_tokens_sum") == 2


def test_priority_classes_label_latencies(model_dirs):
    llm = LLM(str(model_dirs[FAMILY]), dtype="float32", policy="priority", kv_cache_memory="16MiB")
    llm.generate(known_prompts(), SamplingParams(max_tokens=4), use_tqdm=False, priority=[0, 1, 1, 2, 2])
    s = llm.get_metrics()
    assert value(s, "aserve:time_to_first_token_seconds_count", priority=0) == 1
    assert value(s, "aserve:time_to_first_token_seconds_count", priority=2) == 2
    assert value(s, "aserve:e2e_request_latency_seconds_count", priority=1) == 2


# -- dashboards -----------------------------------------------------------------------------------

def dashboard_queries() -> list[tuple[str, str, str]]:
    queries = []
    for path in sorted(GRAFANA.glob("*.json")):
        board = json.loads(path.read_text())
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                queries.append((path.name, f"variable {var['name']}", var["definition"]))
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", (path.name, panel["title"])
            for target in panel["targets"]:
                queries.append((path.name, panel["title"], target["expr"]))
    return queries


def exported_names(samples) -> set[str]:
    return {name for name, _, _ in samples}


def test_every_dashboard_metric_exists_in_the_registry(model_dirs, tmp_path):
    import torch

    from aserve import LoRARequest
    from aserve.bench.lora_bench import write_random_adapter

    adapter = write_random_adapter(tmp_path / "adapter", {"q_proj": (64, 64)}, num_layers=2, rank=4, seed=0,
                                   dtype=torch.float32)  # a request under an adapter: the per-adapter counter
    llm = LLM(str(model_dirs[FAMILY]), dtype="float32", policy="priority", kv_cache_memory="16MiB", enable_lora=True)
    llm.generate(known_prompts(), SamplingParams(max_tokens=4), use_tqdm=False, priority=[0, 1, 0, 1, 0],
                 lora_request=[LoRARequest("ad", 1, str(adapter))] + [None] * 4)
    names = exported_names(llm.get_metrics())
    queries = dashboard_queries()
    assert len(queries) > 20
    for board, title, expr in queries:
        used = set(re.findall(r"aserve:[a-zA-Z0-9_:]+", expr))
        assert used, (board, title, expr)
        assert used <= names, f"{board} / {title}: {sorted(used - names)} not exported"
        if "label_values" not in expr:
            assert all(f'{m}{{model_name="$model_name"}}' in expr for m in used), (board, title, expr)


def test_averages_are_rate_of_sum_over_rate_of_count():
    for board, title, expr in dashboard_queries():
        for metric in re.findall(r"(aserve:[a-z0-9_:]+)_sum", expr):
            assert f"{metric}_count" in expr, (board, title, expr)


def test_shipped_scrape_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (the README's test command installs Debian's prometheus)")
    proc = subprocess.run([promtool, "check", "config", str(GRAFANA / "prometheus.yml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_dashboard_query_returns_data_from_a_real_prometheus(model_dirs, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (the README's test command installs Debian's prometheus)")
    import torch

    from aserve.bench.lora_bench import write_random_adapter

    adapter = write_random_adapter(tmp_path / "adapter", {"q_proj": (64, 64), "v_proj": (64, 32)}, num_layers=2,
                                   rank=4, seed=0, dtype=torch.float32)  # the per-adapter panel needs its traffic
    srv = RunningServer("--model", str(model_dirs[FAMILY]), "--served-model-name", "tiny", "--dtype", "float32",
                        "--kv-cache-memory", str(kv_memory_for_blocks(model_dirs[FAMILY], 12)),
                        "--policy", "priority", "--policy-option", "mode=swap", "--enable-lora",
                        "--lora-modules", f"ad={adapter}")
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: aserve\n"
                      f"    static_configs:\n      - targets: ['127.0.0.1:{srv.port}']\n")
    prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{prom_port}/api/v1"
    try:
        import concurrent.futures

        def one(i):
            body = {"prompt": list(range(1 + i, 40 + i)), "max_tokens": 30, "ignore_eos": True, "priority": i % 2,
                    "model": "ad" if i % 4 == 0 else "tiny"}
            return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code

        def missing_after_a_round() -> list[str]:
            """Serve a round of load, then list the dashboard queries Prometheus has no data for yet."""
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                assert set(pool.map(one, range(16))) == {200}
            missing = []
            for board, title, expr in dashboard_queries():
                query = (expr.replace("$model_name", "tiny").replace("$__rate_interval", "30s"))
                if query.startswith("label_values("):
                    metric = query[len("label_values("):].split(",")[0]
                    query = f"count by (model_name) ({metric})"
                try:
                    answer = httpx.get(f"{api}/query", params={"query": query}, timeout=10)
                except httpx.TransportError:
                    return ["prometheus is not listening yet"]
                if answer.status_code == 503:
                    return ["prometheus is not ready yet"]
                assert answer.json()["status"] == "success", (board, title, query, answer.text)
                if not answer.json()["data"]["result"]:
                    missing.append(f"{board} / {title}: {urllib.parse.unquote(query)}")
            return missing

        # load goes on until every query has data (a rate needs two scrapes in its window), whatever the speed
        wait_for(missing_after_a_round, lambda missing: not missing, "data for every dashboard query", timeout=180)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        srv.stop()


def test_periodic_log_line(caplog):
    from aserve.core.scheduler import SchedulerStats
    from aserve.metrics.loggers import LoggingStatLogger
    from aserve.metrics.stats import IterationStats

    logger = LoggingStatLogger(interval=0.0)
    stats = IterationStats(scheduler=SchedulerStats(num_running=3, num_waiting=2, num_swapped=1, kv_cache_usage=0.5,
                                                     prefix_queries=100, prefix_hits=25),
                           num_steps=1, prompt_tokens=40, generation_tokens=8)
    with caplog.at_level("INFO", logger="aserve"):
        logging_target = __import__("logging").getLogger("aserve")
        logging_target.propagate = True
        try:
            logger.record(stats)
        finally:
            logging_target.propagate = False
    line = caplog.records[-1].getMessage()
    for part in ("running: 3", "waiting: 2", "swapped: 1", "KV cache usage: 50.0%", "prefix cache hit rate: 25.0%",
                 "generation throughput"):
        assert part in line


def test_server_metrics_endpoint(model_dirs):
    srv = RunningServer("--model", str(model_dirs["qwen2"]), "--served-model-name", "tiny", "--dtype", "float32",
                        "--kv-cache-memory", "8MiB")
    try:
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5,
                                                              "ignore_eos": True}).status_code == 200
        from prometheus_client.parser import text_string_to_metric_families

        def scrape():
            text = httpx.get(f"{srv.url}/metrics").text
            return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]

        samples = wait_for(scrape, lambda s: value(s, "aserve:generation_tokens_total") >= 5,
                           "the request's stats in /metrics")
        assert value(samples, "aserve:generation_tokens_total", model_name="tiny") == 5
        assert value(samples, "aserve:prompt_tokens_total", model_name="tiny") == 3
        assert value(samples, "aserve:request_success_total", finished_reason="length") == 1
    finally:
        srv.stop()
