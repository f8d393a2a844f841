"""Tensor parallelism (issue 15): two ranks give the tokens one rank gives, token for token in fp32 (Llama and
Qwen3, KV heads as many as the ranks and fewer), on one machine and on two "nodes" over the loopback; a rank
that dies ends the engine within seconds instead of hanging it. TP=1 equals transformers elsewhere
(test_parity), so TP=2 against TP=1 is the whole claim here."""
from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aserve import AsyncLLM, EngineDeadError, LLM, SamplingParams
from aserve.config import EngineConfig
from aserve.worker.distributed import DistributedPlan, free_port
from conftest import build_tiny_model

VOCAB = 4095  # one model's vocabulary is odd: the last rank's vocab range is padded
rng = random.Random(15)
PROMPTS = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 50))] for _ in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
# per-request seeds: rank 0 samples, the other ranks follow its tokens
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=i) for i in range(len(PROMPTS))]

# name -> (conftest family, config changes). KV heads: 2 = the ranks (split), 1 < the ranks (replicated).
MODELS = {
    "llama-kv2-untied-bias": ("llama-untied", {}),
    "llama-kv1-tied": ("llama-gqa-tied", {"num_key_value_heads": 1}),
    "qwen3-kv2": ("qwen3", {}),
    "qwen3-kv1-odd-vocab": ("qwen3", {"num_key_value_heads": 1, "vocab_size": VOCAB}),
}
OPTIONS = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=48)  # chunked, mixed batches


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    return {name: build_tiny_model(root / name, family, **changes) for name, (family, changes) in MODELS.items()}


def generate(llm: LLM, params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tp_models):
    """(name, TP=1 outputs, the TP=2 LLM): one TP=2 engine per model, shared by the tests of that model."""
    path = tp_models[request.param]
    one = LLM(str(path), **OPTIONS)
    reference = {"greedy": generate(one, GREEDY), "seeded": generate(one, SEEDED)}
    two = LLM(str(path), tensor_parallel_size=2, **OPTIONS)
    yield request.param, reference, two
    two.engine.executor.shutdown()


def test_greedy_tp2_equals_tp1(pair):
    name, reference, llm = pair
    outs = generate(llm, GREEDY)
    assert tokens(outs) == tokens(reference["greedy"]), name
    for got, ref in zip(outs, reference["greedy"]):  # the gathered logits are the same numbers, to rounding
        assert got.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)
    llm.engine.check_idle()  # every rank forgot every request


def test_seeded_sampling_tp2_equals_tp1(pair):
    name, reference, llm = pair
    assert tokens(generate(llm, SEEDED)) == tokens(reference["seeded"]), name
    llm.engine.check_idle()


def test_two_nodes_on_the_loopback(tp_models):
    """Node 0 runs the engine and rank 0; node 1 is `aserve worker` in a process of its own, holding rank 1."""
    path = str(tp_models["qwen3-kv1-odd-vocab"])
    method = f"tcp://127.0.0.1:{free_port()}"
    flags = ["--model", path, "--dtype", "float32", "--kv-cache-memory", "8MiB", "--tensor-parallel-size", "2",
             "--nnodes", "2", "--distributed-init-method", method]
    node1 = subprocess.Popen([sys.executable, "-m", "aserve.cli", "worker", "--node-rank", "1", *flags])
    try:
        llm = LLM(path, tensor_parallel_size=2, nnodes=2, distributed_init_method=method, **OPTIONS)
        assert len(llm.engine.executor.ranks) == 1  # rank 0 only on this "machine"
        got = tokens(generate(llm, GREEDY))
        llm.engine.check_idle()
        llm.engine.executor.shutdown()
        assert node1.wait(30) == 0  # the engine's shutdown reaches the other node, which exits cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
    assert got == tokens(generate(LLM(path, **OPTIONS), GREEDY))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_tp2_equals_tp1(tp_models, method):
    """Rank 0 samples, so it alone runs the draft model (its cache a share of every rank's budget, so the ranks
    agree on their block count); every rank runs the checked proposals. Greedy tokens are those without
    speculation; seeded samples those of one rank with the same draft after the same requests. The draft is
    another model with the target's tokenizer and a vocabulary one token shorter."""
    target = str(tp_models["llama-kv2-untied-bias"])
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if method == "ngram" else
            {"model": str(tp_models["qwen3-kv1-odd-vocab"]), "num_speculative_tokens": 3})
    one = LLM(target, speculative_config=spec, **OPTIONS)
    greedy = tokens(generate(one, GREEDY))  # first, as below: its prefix-cache hits shift when drafts start
    seeded = tokens(generate(one, SEEDED))
    two = LLM(target, tensor_parallel_size=2, speculative_config=spec, **OPTIONS)
    try:
        assert tokens(generate(two, GREEDY)) == greedy == tokens(generate(LLM(target, **OPTIONS), GREEDY))
        assert tokens(generate(two, SEEDED)) == seeded
        assert sum(v for name, _, v in two.get_metrics() if name == "aserve:spec_decode_num_drafts_total") > 0
        two.engine.check_idle()
    finally:
        two.engine.executor.shutdown()


def rank_pids(marker: bytes = b"aserve.worker.tp_worker") -> list[int]:
    """This test's tensor-parallel rank processes (descendants of this process) whose command line holds
    `marker`, from /proc."""
    parents, cmdlines = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
                cmdlines[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue

    def ours(pid):
        while pid in parents and pid > 1:
            pid = parents[pid]
            if pid == os.getpid():
                return True
        return False
    return [pid for pid, cmd in cmdlines.items()
            if b"aserve.worker.tp_worker" in cmd and marker in cmd.split(b"\0") + [cmd] and ours(pid)]


def test_a_rank_killed_mid_generation_ends_the_engine(tp_models):
    """The server's engine (AsyncLLM, the core in its own process): rank 1 is killed while a long generation
    streams; the stream fails with EngineDeadError within seconds, later requests are refused, and no rank is
    left behind."""
    others = set(rank_pids())  # ranks of the engines the tests above keep (module fixtures)

    def ours(marker=b"aserve.worker.tp_worker"):
        return sorted(set(rank_pids(marker)) - others)

    async def main():
        async with AsyncLLM(str(tp_models["llama-kv1-tied"]), tensor_parallel_size=2, distributed_timeout=20,
                            **OPTIONS) as engine:
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            received, killed_at = 0, None
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate({"prompt_token_ids": PROMPTS[0]}, params, "long"):
                    received += 1
                    if received == 3:
                        assert len(ours(b"--rank=0")) == len(ours(b"--rank=1")) == 1 and len(ours()) == 2
                        os.kill(ours(b"--rank=1")[0], signal.SIGKILL)
                        killed_at = time.monotonic()
            assert killed_at is not None and time.monotonic() - killed_at < 10
            with pytest.raises(EngineDeadError):
                await engine.infer({"prompt_token_ids": PROMPTS[1]}, GREEDY)
        for _ in range(100):  # the executor stopped the surviving rank
            if not ours():
                break
            time.sleep(0.1)
        assert not ours()
    asyncio.run(main())


def test_a_hung_rank_ends_the_engine_after_the_collective_timeout(tp_models):
    """A rank that stops answering (SIGSTOP: alive, its connections open) is caught by the process group's
    timeout, not waited on forever; the executor then kills what is left."""
    llm = LLM(str(tp_models["qwen3-kv2"]), tensor_parallel_size=2, distributed_timeout=5, **OPTIONS)
    core, ranks = llm.engine, llm.engine.executor.ranks
    core.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        core.step()
    os.kill(ranks[1][0].pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 0: RuntimeError: .*[Tt]imed out"):
        while True:
            core.step()
    assert 4.5 <= time.monotonic() - stopped_at < 15
    assert all(proc.poll() is not None for proc, _ in ranks.values())
    with pytest.raises(EngineDeadError):  # and it stays dead
        core.step()


def test_plans_from_flags_and_torchrun_variables():
    config = EngineConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, distributed_init_method="tcp://10.0.0.1:29500")
    plan = DistributedPlan.for_node(config, env={})
    assert (plan.host, plan.port, plan.ranks, plan.local_ranks) == ("10.0.0.1", 29500, (2, 3), (0, 1))
    engine = DistributedPlan.for_engine(EngineConfig(tensor_parallel_size=4, nnodes=2), env={
        "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"})
    assert (engine.init_method, engine.ranks) == ("tcp://10.0.0.9:1234", (0, 1))
    single = DistributedPlan.for_node(EngineConfig(tensor_parallel_size=2, nnodes=2), env={
        "MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert (single.ranks, single.local_ranks) == ((1,), (0,))
    with pytest.raises(ValueError, match="distributed-init-method"):
        DistributedPlan.for_engine(EngineConfig(tensor_parallel_size=2, nnodes=2), env={})
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        DistributedPlan.for_node(EngineConfig(tensor_parallel_size=2, nnodes=2), env={
            "MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)


def test_models_the_ranks_cannot_split_are_refused_before_any_process_starts(tp_models, tmp_path):
    with pytest.raises(ValueError, match="does not support tensor parallelism"):
        LLM(str(build_tiny_model(tmp_path / "opt", "opt")), tensor_parallel_size=2, **OPTIONS)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(tp_models["qwen3-kv2"]), tensor_parallel_size=3, **OPTIONS)


def test_a_rank_that_cannot_load_fails_the_start_with_its_reason(tp_models, tmp_path):
    """Every rank hears of the failure at the rendezvous and answers Failed; the engine raises, naming the cause,
    and no rank is left behind."""
    path = tmp_path / "no-weights"
    shutil.copytree(tp_models["qwen3-kv2"], path)
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    others = set(rank_pids())
    with pytest.raises(RuntimeError, match="could not load the model: FileNotFoundError: no model.safetensors"):
        LLM(str(path), tensor_parallel_size=2, **OPTIONS)
    assert not set(rank_pids()) - others


def test_nodes_started_with_other_options_are_refused_by_name(tp_models):
    """The ranks' facts (RankStatus, msgspec JSON in the rendezvous store) must agree: node 1 with another block
    size fails both ranks with a ValueError that says which rank differs and how."""
    path = str(tp_models["qwen3-kv2"])
    method = f"tcp://127.0.0.1:{free_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "aserve.cli", "worker", "--node-rank", "1", "--model", path,
                              "--dtype", "float32", "--kv-cache-memory", "8MiB", "--tensor-parallel-size", "2",
                              "--nnodes", "2", "--distributed-init-method", method, "--block-size", "32"])
    try:
        with pytest.raises(ValueError, match=r"rank 1 differs from rank 0 \(RankFacts\(.*block_size=32"):
            LLM(path, tensor_parallel_size=2, nnodes=2, distributed_init_method=method, **OPTIONS)
        assert node1.wait(30) == 1
    finally:
        if node1.poll() is None:
            node1.kill()
