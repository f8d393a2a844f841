"""The execution layer's seams hold: the core and the engine options are free of torch, the scheduler hands the
worker plain data whose diffs rebuild exactly the scheduler's view, models load lazily by architecture, backends by
name."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.attention import select_backend
from aserve.models.registry import architecture, supported
from aserve.sampling_params import SamplingParams as Params
from conftest import kv_memory_for_blocks, random_prompts

PLAIN = (str, int, float, bool, bytes, type(None), Params)  # bytes: a structured-output bitmask's rows


def test_the_core_and_the_settings_import_no_torch():
    """The engine options and their checks too (config, and the weight formats' spec it reads), so a wrong flag
    fails before torch loads (tests/test_floors.py: the settings floor)."""
    code = ("import sys, aserve.core.scheduler, aserve.core.kv_cache_manager, aserve.core.block_pool, "
            "aserve.models.registry, aserve.config, aserve.quantization; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_command_refuses_a_bad_flag_before_importing_torch(tmp_path):
    """`aserve` builds every subcommand's parser (the benchmarks' too) and checks the engine options without torch:
    a wrong folder or policy is a fraction of a second, not the seconds torch takes to import. The server and
    every benchmark that loads a model alike."""
    missing = str(tmp_path / "missing")
    commands = [["--model", missing], ["bench", "throughput", "--model", missing],
                ["bench", "embed", "--model", missing], ["bench", "roofline", "--model", missing],
                ["bench", "throughput", "--policy", "nope"], ["bench", "policies", "--policies", "fcfs,nope"]]
    code = ("import sys\nfrom aserve import cli\n"
            f"for argv in {commands!r}:\n"
            "    try:\n        cli.main(argv)\n    except SystemExit as exit:\n"
            "        assert exit.code == 2, (argv, exit.code)\n"
            "    else:\n        raise AssertionError(f'{argv} was accepted')\n"
            "    assert 'torch' not in sys.modules, f'{argv}: torch was imported'\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    errors = ran.stderr.strip().splitlines()
    assert len(errors) == len(commands) and all(line.startswith("aserve: error: ") for line in errors), errors
    assert sum("does not exist" in line for line in errors) == 4
    assert sum("unknown policy 'nope'" in line for line in errors) == 2


def assert_plain(value, where="SchedulerOutput"):
    if dataclasses.is_dataclass(value) and not isinstance(value, Params):
        for f in dataclasses.fields(value):
            assert_plain(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            assert_plain(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            assert_plain(key, f"{where} key")
            assert_plain(item, f"{where}[{key!r}]")
    else:
        assert isinstance(value, PLAIN), f"{where} holds a {type(value).__name__}"


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap"])
def test_the_worker_rebuilds_the_schedulers_view_from_plain_diffs(model_dirs, policy, steps):
    """Under preemption (recompute or swap), n > 1 forks (copy-on-write) and prefix-cache hits, the worker's
    block tables and progress equal the scheduler's after every step, one at a time or several a batch
    (num_scheduler_steps), and it forgets finished requests."""
    path = model_dirs["llama-gqa-tied"]
    llm = LLM(str(path), dtype="float32", policy=policy, kv_cache_memory=kv_memory_for_blocks(path, 9),
              swap_space=str(kv_memory_for_blocks(path, 40)), max_num_batched_tokens=24, num_scheduler_steps=steps)
    engine = llm.engine
    real_execute, seen = engine.executor.execute, {"new": 0, "diff": 0, "replaced": 0, "finished": 0, "steps": 1}

    def execute(sched):
        assert_plain(sched)
        seen["new"] += len(sched.new_requests)
        seen["diff"] += len(sched.cached_requests)
        seen["replaced"] += sum(d.replace_blocks for d in sched.cached_requests)
        seen["finished"] += len(sched.finished_ids)
        seen["steps"] = max(seen["steps"], sched.num_steps)
        out = real_execute(sched)
        states = engine.runner.requests
        ran = {request_id for request_id, _ in sched.num_scheduled_tokens}
        for req in (r for r, _ in engine.scheduler.scheduled if r.request_id in ran):
            state = states[req.request_id]
            assert state.block_table == req.block_table and state.num_computed_tokens == req.num_computed_tokens
            assert state.all_token_ids == req.all_token_ids + (out.sampled[req.request_id].token_ids
                                                                if req.request_id in out.sampled else [])
        return out

    engine.executor.execute = execute
    shared = random_prompts(1, lengths=(40, 40), seed=5)[0]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, lengths=(20, 60), seed=4, prefix=shared)]
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20), use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
    assert seen["new"] == 12 and seen["diff"] > 0 and seen["replaced"] > 0 and seen["finished"] == 12
    assert seen["steps"] == steps
    engine.check_idle()  # includes: the worker holds no request states


def test_backends_are_chosen_by_device_or_name():
    assert select_backend(None, torch.device("cpu")).name == "torch"
    assert select_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="attention backend 'nope' is unknown; available: .*torch"):
        select_backend("nope", torch.device("cpu"))


def test_an_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*not supported; supported: .*Gemma2ForCausalLM"):
        architecture({"architectures": ["GPTNeoXForCausalLM"]})
    assert {"LlamaForCausalLM", "MistralForCausalLM", "OPTForCausalLM", "GPT2LMHeadModel", "Phi3ForCausalLM",
            "Gemma2ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(supported())


def test_model_families_are_imported_only_when_used():
    code = ("import sys, aserve.models.loader; "
            "assert not [m for m in sys.modules if m.startswith('aserve.models.') and m.split('.')[-1] in "
            "('llama', 'gpt2', 'opt', 'gemma2', 'phi3', 'mistral')], 'a model family was imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True)
