"""Executor: how the engine core reaches its workers. In-process for one rank; with tensor parallelism the
multi-process executor (worker.multiproc_executor), one worker process per rank, implements the same members."""
from __future__ import annotations

from typing import Protocol

from aserve.config import EngineConfig
from aserve.core.scheduler import SchedulerOutput
from aserve.worker.model_runner import ModelRunnerOutput
from aserve.worker.worker import Worker, WorkerInfo


class Executor(Protocol):
    info: WorkerInfo

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def live_request_ids(self) -> list[str]: ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    """The worker in the engine core's own process: a step is a function call."""

    def __init__(self, config: EngineConfig):
        self.worker = Worker(config)
        self.info = self.worker.info

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(sched)

    def live_request_ids(self) -> list[str]:
        """The requests the worker still holds (an idle engine's: none)."""
        return sorted(self.worker.runner.requests)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig) -> Executor:
    if config.distributed_executor_backend == "ray":
        from aserve.worker.ray_executor import RayExecutor

        return RayExecutor(config)
    if config.world_size > 1:
        from aserve.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    return UniprocExecutor(config)
