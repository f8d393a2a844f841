"""The `aserve` command: the default generation, the throughput benchmark's vLLM-format last line, and
configuration errors refused as one line with status 2 before any model loads."""
import json
import re
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "aserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_bench_throughput_prints_vllm_format(model_dirs):
    proc = run("bench", "throughput", "--model", str(model_dirs["qwen2"]), "--num-prompts", "6", "--input-len", "12",
               "--output-len", "5", "--kv-cache-memory", "8MiB", "--top-p", "0.9", "--repetition-penalty", "1.2")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"Throughput: ([0-9.]+) requests/s, ([0-9.]+) total tokens/s, ([0-9.]+) output tokens/s", last)
    assert m, last
    requests, total, output = map(float, m.groups())
    assert output > 0 and abs(total / output - (12 + 5) / 5) < 1e-2 * total / output


def test_bench_throughput_with_random_lora_adapters(model_dirs):
    """--num-loras writes random PEFT adapters, runs base alone and adapters round-robin in turn, prints the ratio."""
    proc = run("bench", "throughput", "--model", str(model_dirs["llama-gqa-tied"]), "--num-prompts", "6",
               "--input-len", "12", "--output-len", "5", "--kv-cache-memory", "8MiB", "--num-loras", "3",
               "--lora-rank", "8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("base model alone Throughput:") for line in lines) == 2
    assert sum(line.startswith("3 adapters, round-robin Throughput:") for line in lines) == 2
    m = re.fullmatch(r"output tokens/s ratio LoRA/base = ([0-9.]+) \(3 adapters, max_loras 3, rank 8, 2 alternating "
                     r"rounds\)", lines[-1])
    assert m and float(m.group(1)) > 0, lines[-1]


def test_bench_embed_against_sentence_transformers(model_dirs):
    """Two alternated rounds (one run: the comparison loads sentence-transformers, seconds of the suite): each
    round's three lines, then their median."""
    pytest.importorskip("sentence_transformers")
    proc = run("bench", "embed", "--model", str(model_dirs["qwen3"]), "--num-prompts", "12", "--min-len", "4",
               "--max-len", "30", "--batch-size", "4", "--kv-cache-memory", "8MiB", "--compare-sentence-transformers",
               "--rounds", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 + 3 * 2 + 1, lines
    ratios = []
    for r in range(2):  # each round: aserve, sentence-transformers, their ratio
        ours, theirs, ratio = lines[1 + 3 * r:4 + 3 * r]
        assert ours.startswith("aserve: ") and "sentences/s" in ours and "12 prompts of 4-30 tokens" in ours
        assert theirs.startswith("sentence-transformers: ") and "(batch size 4)" in theirs
        m = re.fullmatch(r"sentences/s ratio aserve/sentence-transformers = ([0-9.]+)", ratio)
        assert m and float(m.group(1)) > 0, ratio
        ratios.append(m.group(1))
    m = re.fullmatch(r"median ratio over 2 rounds = ([0-9.]+) \((.+)\)", lines[-1])
    assert m and m.group(2) == " / ".join(ratios), lines[-1]


def test_default_command_generates_on_the_embedded_model():
    proc = run("generate", "--prompt", "def main():", "--max-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    assert "def main():" in proc.stdout


def test_errors_are_one_line(tmp_path):
    proc = run("bench", "throughput", "--model", str(tmp_path / "missing"), "--num-prompts", "1")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("aserve: error:")
    assert "Traceback" not in proc.stderr


def assert_one_line_error(proc, *expected):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aserve: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])


def test_an_unknown_policy_is_refused_before_the_model_loads():
    assert_one_line_error(run("--policy", "nope"), "unknown policy 'nope'", "installed policies:", "fcfs-swap",
                          "priority")


def test_an_unknown_architecture_is_refused_before_the_model_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    assert_one_line_error(run("--model", str(tmp_path)), str(tmp_path), "FooForCausalLM", "LlamaForCausalLM",
                          "Qwen2ForCausalLM")


def test_a_missing_model_folder_is_refused(tmp_path):
    assert_one_line_error(run("serve", "--model", str(tmp_path / "missing")), "does not exist",
                          str(tmp_path / "missing"))


def test_a_policy_option_the_policy_does_not_take_is_refused():
    assert_one_line_error(run("--policy", "priority", "--policy-option", "no_such_option=1"),
                          "policy 'priority' failed to construct", "no_such_option")


def test_engine_flags_are_generated_from_engine_config_and_shared():
    from dataclasses import fields

    from aserve.cli import build_parser
    from aserve.config import EngineConfig, engine_options

    assert all(f.metadata["help"] for f in fields(EngineConfig))
    parser = build_parser()
    flags = ["--block-size", "32", "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching", "--policy", "priority",
             "--policy-option", "aging=0.5", "--policy-option", "mode=swap", "--swap-space", "512MiB",
             "--max-num-seqs", "8", "--max-waiting-requests", "3"]
    for command in (["serve"], ["bench", "throughput"], ["generate"]):
        options = engine_options(parser.parse_args(command + flags))
        assert set(options) == {f.name for f in fields(EngineConfig)}, command
        config = EngineConfig(**options)
        assert (config.block_size, config.kv_cache_memory, config.enable_prefix_caching, config.policy,
                config.policy_options, config.swap_space, config.max_num_seqs, config.max_waiting_requests) == (
            32, 2 ** 30, False, "priority", {"aging": 0.5, "mode": "swap"}, 512 * 2 ** 20, 8, 3), command
        assert EngineConfig(**engine_options(parser.parse_args(command))) == EngineConfig(), command  # same defaults
    bench = engine_options(parser.parse_args(["bench", "policies", "--swap-space", "2"]))
    assert "policy" not in bench and (bench["kv_cache_memory"], bench["swap_space"], bench["max_num_seqs"]) == (
        "auto", 2.0, 64)


def test_the_step_token_budget_defaults_by_device_and_an_explicit_one_wins():
    import pytest
    import torch

    from aserve.config import EngineConfig

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert (EngineConfig().token_budget(cpu), EngineConfig().token_budget(gpu)) == (512, 2048)
    assert EngineConfig(max_num_batched_tokens=96).token_budget(cpu) == 96
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineConfig(max_num_batched_tokens=0)


def test_benchmarks_refuse_a_bad_policy_before_loading(tmp_path):
    assert_one_line_error(run("bench", "throughput", "--policy", "nope", "--num-prompts", "1"), "unknown policy 'nope'")
    assert_one_line_error(run("bench", "policies", "--policies", "fcfs,nope"), "unknown policy 'nope'", "fcfs-swap")


def test_the_command_ends_with_the_status_asked_for_after_the_atexit_handlers(tmp_path):
    """`aserve` leaves without the interpreter's teardown (aserve.process_exit): a SystemExit's message still
    reaches stderr with status 1, and atexit handlers still run before the process ends with its status."""
    refused = run("bench", "roofline", "--tensor-parallel-size", "2")
    assert refused.returncode == 1 and "measures one process" in refused.stderr, refused.stderr
    mark = tmp_path / "ran"
    code = ("import atexit, pathlib\nfrom aserve.process_exit import exit_now\n"
            f"atexit.register(pathlib.Path({str(mark)!r}).write_text, 'atexit ran')\n"
            "print('flushed', end='')\nexit_now(3)\n")
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert ended.returncode == 3 and ended.stdout == "flushed" and mark.read_text() == "atexit ran"


def test_python_dash_m_aserve_is_the_aserve_command():
    by_module = subprocess.run([sys.executable, "-m", "aserve", "policies"], capture_output=True, text=True, timeout=120)
    by_cli = run("policies")
    assert by_module.returncode == by_cli.returncode == 0, by_module.stderr
    assert by_module.stdout == by_cli.stdout and "fcfs" in by_module.stdout
