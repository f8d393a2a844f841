"""Executor: how the engine core reaches its workers. In-process now (one worker); the multi-process
executor, one worker per tensor-parallel rank, implements the same three members."""
from __future__ import annotations

from typing import Protocol

from aserve.config import EngineConfig
from aserve.core.scheduler import SchedulerOutput
from aserve.worker.model_runner import ModelRunnerOutput
from aserve.worker.worker import Worker, WorkerInfo


class Executor(Protocol):
    info: WorkerInfo

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    """The worker in the engine core's own process: a step is a function call."""

    def __init__(self, config: EngineConfig):
        self.worker = Worker(config)
        self.info = self.worker.info

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(sched)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig) -> Executor:
    return UniprocExecutor(config)
