"""Pipeline parallelism (issue 35): the layers split into stages, one process per rank, hidden states passed
stage to stage, up to pipeline_parallel_size batches in flight. P = 2 gives the tokens P = 1 gives, token for token
in fp32 greedy and in seeded sampling (Llama, Qwen3, Gemma 2 with an odd layer count), also with T = 2 inside each
stage, a hand partition, prefix-cache hits and preemption; a stage holds only its own layers; a killed stage ends
the engine with a clear error and leaves no process behind."""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from aserve import LLM, EngineDeadError, SamplingParams
from aserve.models.loader import load_model
from aserve.models.parallel import PipelineStage, layer_partition, pipeline_stages
from conftest import build_tiny_model, kv_memory_for_blocks
from test_tensor_parallel import rank_pids

rng = random.Random(35)
PROMPTS = [[rng.randrange(1, 4096) for _ in range(rng.randint(1, 50))] for _ in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=i) for i in range(len(PROMPTS))]
OPTIONS = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=48)  # chunked, mixed batches
FAMILIES = ["llama-gqa-tied", "qwen3", "gemma2"]


@pytest.fixture(scope="module")
def pp_models(tmp_path_factory) -> dict[str, Path]:
    """Five layers each: an odd count, so the stages differ in size."""
    root = tmp_path_factory.mktemp("pp-models")
    return {family: build_tiny_model(root / family, family, num_hidden_layers=5) for family in FAMILIES}


def generate(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                         use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(pp_models) -> dict[str, dict[str, list]]:
    """One rank's tokens, greedy and seeded, per family."""
    found = {}
    for family, path in pp_models.items():
        llm = LLM(str(path), **OPTIONS)
        found[family] = {"greedy": generate(llm, GREEDY), "seeded": generate(llm, SEEDED)}
    return found


def test_partitions_follow_vllm_and_hand_ones_are_checked():
    assert layer_partition(5, 2) == [3, 2]
    assert layer_partition(30, 4) == [7, 8, 8, 7]  # the remainder to the stages before the last
    assert layer_partition(7, 4) == [2, 2, 2, 1]
    assert layer_partition(6, 2, "2,4") == [2, 4]
    assert [(s.start, s.end, s.first, s.last) for s in pipeline_stages(5, 2, "1,4")] == [(0, 1, True, False),
                                                                                       (1, 5, False, True)]
    for bad in ("2,2", "1,1,3", "0,5", "a,b"):
        with pytest.raises(ValueError, match="pp_layer_partition"):
            layer_partition(5, 2, bad)
    with pytest.raises(ValueError, match="more than the model's 5 layers"):
        layer_partition(5, 6)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stages_equal_one_rank(pp_models, reference, family):
    llm = LLM(str(pp_models[family]), pipeline_parallel_size=2, **OPTIONS)
    try:
        greedy, seeded = generate(llm, GREEDY), generate(llm, SEEDED)
        assert greedy == reference[family]["greedy"]
        assert seeded == reference[family]["seeded"]
        assert llm.engine.pipeline_depth == 2
        llm.engine.check_idle()  # every rank of both stages forgot every request
    finally:
        llm.engine.executor.shutdown()


def test_two_stages_of_two_ranks_and_a_hand_partition(pp_models, reference):
    for options in (dict(tensor_parallel_size=2, pipeline_parallel_size=2),
                    dict(pipeline_parallel_size=2, pp_layer_partition="1,4"),
                    dict(pipeline_parallel_size=3)):
        llm = LLM(str(pp_models["qwen3"]), **options, **OPTIONS)
        try:
            assert generate(llm, GREEDY) == reference["qwen3"]["greedy"], options
            llm.engine.check_idle()
        finally:
            llm.engine.executor.shutdown()


def test_batches_are_in_flight_together(pp_models, monkeypatch):
    """With enough requests the engine keeps two batches in the pipeline: stage 0 runs one while stage 1 runs
    the other; a request is never in both."""
    llm = LLM(str(pp_models["llama-gqa-tied"]), pipeline_parallel_size=2, **OPTIONS)
    engine, depths = llm.engine, []
    real = engine.executor.submit

    def submit(sched):
        in_flight = {rid for s, _ in engine._in_flight for rid, _ in s.num_scheduled_tokens}
        assert not in_flight & {rid for rid, _ in sched.num_scheduled_tokens}
        real(sched)
        depths.append(len(engine._in_flight) + 1)
    monkeypatch.setattr(engine.executor, "submit", submit)
    try:
        generate(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert max(depths) == 2 and depths.count(2) > 10
        engine.check_idle()
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap"])
def test_prefix_hits_and_preemption_under_two_stages(pp_models, policy):
    """A cache of 12 blocks for 8 prompts (preempted as they grow, recomputed or swapped), run twice (the second
    round's prompts hit the prefix cache): the tokens of one rank with the same cache."""
    path = pp_models["llama-gqa-tied"]
    options = dict(dtype="float32", policy=policy, max_num_batched_tokens=48,
                   kv_cache_memory=kv_memory_for_blocks(path, 12, dtype_bytes=4) // 5 * 3,  # the largest stage's 3
                   swap_space=str(kv_memory_for_blocks(path, 64)))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    one = LLM(str(path), **{**options, "kv_cache_memory": kv_memory_for_blocks(path, 12)})
    want = generate(one, params)
    two = LLM(str(path), pipeline_parallel_size=2, **options)
    try:
        assert two.engine.kv.num_blocks == one.engine.kv.num_blocks == 12
        for _ in range(2):
            assert generate(two, params) == want
        stats = two.engine.scheduler.stats()
        assert stats.preemptions["swap" if policy == "fcfs-swap" else "recompute"] > 0
        assert stats.prefix_hits > 0
        two.engine.check_idle()
    finally:
        two.engine.executor.shutdown()


@pytest.mark.parametrize("stages", [1, 2])
def test_a_request_the_scheduler_fails_is_reported_from_either_loop(pp_models, stages):
    """The scheduler ends a request with an error while making a batch (a beam search it can neither swap nor
    recompute: test_beam_search.py reaches that with one rank); the engine reports it after scheduling, from the
    one-batch loop and from the pipeline's batch queue alike, and the other request finishes as usual."""
    from aserve.request import RequestStatus

    llm = LLM(str(pp_models["llama-gqa-tied"]), pipeline_parallel_size=stages, **OPTIONS)
    engine, scheduler = llm.engine, llm.engine.scheduler
    try:
        engine.add_request(PROMPTS[0], GREEDY, request_id="kept")
        engine.add_request(PROMPTS[1], GREEDY, request_id="failed")
        real_schedule = scheduler.schedule

        def schedule(*args):
            doomed = [r for r in scheduler.waiting if r.request_id == "failed"]
            for req in doomed:  # what _fail_unmovable does
                scheduler.finish(req, RequestStatus.FINISHED_ERROR, error="no room to keep it")
                scheduler.failed.append(req)
            return real_schedule(*args)

        scheduler.schedule = schedule
        done = {}
        for _ in range(200):
            done |= {out.request_id: out for out in engine.step() if out.finished}
            if not engine.has_unfinished():
                break
        assert set(done) == {"kept", "failed"}
        assert (done["failed"].outputs[0].finish_reason, done["failed"].outputs[0].error) == ("error",
                                                                                            "no room to keep it")
        assert done["kept"].outputs[0].finish_reason == "length" and len(done["kept"].outputs[0].token_ids) == 16
        engine.check_idle()
    finally:
        engine.executor.shutdown()


def test_a_stage_holds_its_own_layers_only(pp_models):
    path = pp_models["llama-gqa-tied"]
    whole = dict(load_model(path, "float32").model.named_parameters())
    first, last = (load_model(path, "float32", stage=s).model for s in pipeline_stages(5, 2))
    assert first.shape.num_layers == 3 and last.shape.num_layers == 2
    assert first.norm is None and first.output_weight() is None
    assert last.embed_tokens is not None  # tied: the last stage's head
    for name, param in first.named_parameters():
        assert torch.equal(param, whole[name]), name
    for name, param in last.named_parameters():
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            assert torch.equal(param, whole[f"layers.{int(index) + 3}.{rest}"]), name
        else:
            assert torch.equal(param, whole[name]), name
    assert not any(n.startswith("layers.3") for n, _ in first.named_parameters())


def test_a_stage_reads_nothing_of_the_other_stages_layers(pp_models, monkeypatch):
    """The loader hands safetensors slices to a stage; only its own layers (and the embedding it needs) are read."""
    from aserve.models import loader

    read: set[str] = set()
    real = loader.checkpoint_tensors

    class Recorded:
        def __init__(self, name, part):
            self.name, self.part = name, part

        def __getitem__(self, index):
            read.add(self.name)
            return self.part[index]

        def get_shape(self):
            return self.part.get_shape()

    def recorded(files, lazy=False):
        assert lazy  # a stage reads slices, not whole tensors
        for file_name, name, part in real(files, lazy):
            yield file_name, name, Recorded(name, part)
    monkeypatch.setattr(loader, "checkpoint_tensors", recorded)
    first = pipeline_stages(5, 2)[0]
    load_model(pp_models["llama-gqa-tied"], "float32", stage=first)
    assert read and all(name.startswith(("model.layers.0.", "model.layers.1.", "model.layers.2.",
                                         "model.embed_tokens.")) for name in read), sorted(read)


def test_what_pipelines_do_not_run_is_refused_before_any_process_starts(pp_models, tmp_path):
    path = str(pp_models["llama-gqa-tied"])
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        LLM(str(build_tiny_model(tmp_path / "opt", "opt")), pipeline_parallel_size=2, **OPTIONS)
    with pytest.raises(ValueError, match="with speculative decoding is not supported yet"):
        LLM(path, pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            **OPTIONS)
    with pytest.raises(ValueError, match="pp_layer_partition"):
        LLM(path, pipeline_parallel_size=2, pp_layer_partition="2,2", **OPTIONS)
    with pytest.raises(ValueError, match="needs pipeline_parallel_size > 1"):
        LLM(path, pp_layer_partition="2,3", **OPTIONS)


def test_a_killed_stage_ends_the_engine_and_leaves_no_process(pp_models):
    others = set(rank_pids())

    def ours(marker=b"aserve.worker.tp_worker"):
        return sorted(set(rank_pids(marker)) - others)

    llm = LLM(str(pp_models["llama-gqa-tied"]), pipeline_parallel_size=2, distributed_timeout=20, **OPTIONS)
    core = llm.engine
    core.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert len(ours()) == 2
    os.kill(ours(b"--rank=1")[0], signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank"):
        while True:
            core.step()
    assert time.monotonic() - killed_at < 10
    for _ in range(100):
        if not ours():
            break
        time.sleep(0.1)
    assert not ours()
    with pytest.raises(EngineDeadError):
        core.step()


def test_a_hung_stage_ends_the_engine_after_the_timeout(pp_models):
    """The last stage stops answering (SIGSTOP): rank 0's wait for its output times out, and the engine ends."""
    llm = LLM(str(pp_models["qwen3"]), pipeline_parallel_size=2, distributed_timeout=5, **OPTIONS)
    core, ranks = llm.engine, llm.engine.executor.ranks
    core.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        core.step()
    os.kill(ranks[1][0].pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 0: .*[Tt]imed out"):
        while True:
            core.step()
    assert 4.5 <= time.monotonic() - stopped_at < 15
    assert all(proc.poll() is not None for proc, _ in ranks.values())
