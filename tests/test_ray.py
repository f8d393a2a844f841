"""The Ray backend (issue 35): every rank placed on a Ray cluster, here two nodes that Ray's own test utility starts
on this machine (bound to the loopback), gives the tokens of the multi-process backend; a rank whose actor dies ends
the engine with a clear error and gives the cluster its CPUs back; a cluster too small is refused at once."""
from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray")

from aserve import LLM, EngineDeadError  # noqa: E402
from aserve.errors import ConfigError  # noqa: E402
from test_pipeline_parallel import GREEDY, OPTIONS, PROMPTS, SEEDED, generate  # noqa: E402
from test_pipeline_parallel import pp_models, reference  # noqa: E402, F401 - the fixtures


@pytest.fixture(scope="module")
def loopback():
    """Every Ray address on 127.0.0.1 (Ray's switch for loopback-only clusters), for this module's tests."""
    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    yield
    if saved is None:
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    else:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved


@pytest.fixture(scope="module")
def cluster(loopback):
    """Two Ray nodes of two (logical) CPUs each."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes.add_node(num_cpus=2)
    ray.init(address=nodes.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def assert_cpus_given_back() -> None:
    """Within 5 s the cluster has all 4 CPUs free again: the engine's actors (and placement group) are gone."""
    for _ in range(50):
        if ray.available_resources().get("CPU", 0) == 4:
            return
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 4


@pytest.fixture(scope="module")
def seeded_by_tp(pp_models, reference):
    """Seeded tokens of the multi-process backend by tensor-parallel size, computed once: pipeline stages pass
    their hidden states on exactly, so the split into stages does not change them, while the split into
    tensor-parallel halves does."""
    cache = {1: reference["qwen3"]["seeded"]}

    def seeded(tp: int) -> list:
        if tp not in cache:
            local = LLM(str(pp_models["qwen3"]), tensor_parallel_size=tp, **OPTIONS)
            try:
                cache[tp] = generate(local, SEEDED)
            finally:
                local.engine.executor.shutdown()
        return cache[tp]
    return seeded


@pytest.mark.parametrize("shape, cpus, nodes", [
    (dict(pipeline_parallel_size=2), 2, 2),  # a stage a node (each rank takes a whole node's 2 CPUs)
    (dict(tensor_parallel_size=2), 1, 1),  # packed onto one node
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2), 1, 2),
])
def test_ray_ranks_equal_one_rank(cluster, pp_models, reference, seeded_by_tp, shape, cpus, nodes):
    """Greedy tokens equal one rank's; seeded ones equal the multi-process backend's with the same tensor-parallel
    split. Tensor parallelism sums a layer's halves in another order than one rank does (logprobs within ~1e-6 on
    these tiny models, whose distributions are nearly flat), so a seeded draw may land on the other side of a
    boundary."""
    seeded = seeded_by_tp(shape.get("tensor_parallel_size", 1))
    llm = LLM(str(pp_models["qwen3"]), distributed_executor_backend="ray", ray_cpus_per_rank=cpus, **shape,
              **OPTIONS)
    try:
        assert llm.engine.executor.plan.nnodes == nodes
        assert generate(llm, GREEDY) == reference["qwen3"]["greedy"]
        assert generate(llm, SEEDED) == seeded
        llm.engine.check_idle()
    finally:
        llm.engine.executor.shutdown()
    assert_cpus_given_back()


def test_a_lost_rank_actor_ends_the_engine(cluster, pp_models):
    from aserve import SamplingParams

    llm = LLM(str(pp_models["llama-gqa-tied"]), distributed_executor_backend="ray", pipeline_parallel_size=2,
              distributed_timeout=20, **OPTIONS)
    core = llm.engine
    core.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        core.step()
    ray.kill(core.executor.ranks[1][0].actor, no_restart=True)
    killed_at = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        while True:
            core.step()
    assert time.monotonic() - killed_at < 10
    assert_cpus_given_back()


def test_a_cluster_too_small_is_refused_at_once(cluster, pp_models):
    started = time.monotonic()
    with pytest.raises(ConfigError, match="cannot hold 2 ranks of 3 CPU"):
        LLM(str(pp_models["qwen3"]), distributed_executor_backend="ray", pipeline_parallel_size=2,
            ray_cpus_per_rank=3, **OPTIONS)
    assert time.monotonic() - started < 5


def test_data_parallel_replicas_placed_by_ray(cluster, pp_models, reference):
    """Two replicas, each a Ray actor taking a whole node's CPUs: both serve, the answers are one engine's, and a
    replica whose actor dies loses only its own requests while the other serves on."""
    import asyncio

    from aserve import AsyncLLM

    async def main():
        async with AsyncLLM(str(pp_models["qwen3"]), data_parallel_size=2, data_parallel_backend="ray",
                            ray_cpus_per_rank=2, **OPTIONS) as engine:
            actors = [core.proc.actor for core in engine.replicas.replicas]
            assert len({core.proc.node_id for core in engine.replicas.replicas}) == 2
            outs = await asyncio.gather(*[engine.infer({"prompt_token_ids": p}, GREEDY) for p in PROMPTS])
            assert [o.outputs[0].token_ids for o in outs] == reference["qwen3"]["greedy"]
            done: dict[str, float] = {}
            for name, lab, v in engine.get_metrics():
                if name == "aserve:request_success_total":
                    done[lab["replica"]] = done.get(lab["replica"], 0) + v
            assert len(done) == 2 and min(done.values()) >= 1  # both replicas served
            ray.kill(actors[1], no_restart=True)
            for _ in range(100):
                if (await engine.state())["num_replicas_alive"] == 1:
                    break
                await asyncio.sleep(0.1)
            outs = await asyncio.gather(*[engine.infer({"prompt_token_ids": p}, GREEDY) for p in PROMPTS[:3]])
            assert [o.outputs[0].token_ids for o in outs] == reference["qwen3"]["greedy"][:3]
    asyncio.run(main())
    assert_cpus_given_back()


def test_a_lost_node_ends_the_engine(cluster, pp_models):
    """The worker node, holding one stage, is removed for good; the engine ends with an error naming the rank.
    Last in this module: it takes the module's cluster's second node away (starting a cluster of its own cost
    seconds of the suite)."""
    from aserve import SamplingParams

    [worker] = cluster.worker_nodes
    llm = LLM(str(pp_models["llama-gqa-tied"]), distributed_executor_backend="ray", pipeline_parallel_size=2,
              ray_cpus_per_rank=2, distributed_timeout=20, **OPTIONS)
    core = llm.engine
    on_worker = [rank for rank, (proc, _) in core.executor.ranks.items() if proc.node_id == worker.node_id]
    assert len(on_worker) == 1
    core.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        core.step()
    cluster.remove_node(worker)
    lost_at = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank"):
        while True:
            core.step()
    assert time.monotonic() - lost_at < 25
    core.executor.shutdown()
