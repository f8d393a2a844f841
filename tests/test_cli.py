"""The `aserve` command: the default generation and the throughput benchmark's vLLM-format last line."""
import re
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "aserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_bench_throughput_prints_vllm_format(model_dirs):
    proc = run("bench", "throughput", "--model", str(model_dirs["qwen2"]), "--num-prompts", "6", "--input-len", "12",
               "--output-len", "5", "--kv-cache-memory", "8MiB")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"Throughput: ([0-9.]+) requests/s, ([0-9.]+) total tokens/s, ([0-9.]+) output tokens/s", last)
    assert m, last
    requests, total, output = map(float, m.groups())
    assert output > 0 and abs(total / output - (12 + 5) / 5) < 1e-2 * total / output


def test_default_command_generates_on_the_embedded_model():
    proc = run("generate", "--prompt", "def main():", "--max-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    assert "def main():" in proc.stdout


def test_errors_are_one_line(tmp_path):
    proc = run("bench", "throughput", "--model", str(tmp_path / "missing"), "--num-prompts", "1")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("aserve: error:")
    assert "Traceback" not in proc.stderr
