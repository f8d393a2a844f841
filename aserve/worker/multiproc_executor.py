"""The multi-process executor: tensor parallelism over N worker processes, one rank each.

Every rank, rank 0 included, is a process of its own (worker.tp_worker); the engine core only sends steps to
rank 0 over a pipe and reads back its sampled output. Chosen over making the engine core's process rank 0
because then every rank is the same program whichever machine it runs on, the ranks' threads never share a GIL
with the scheduler (or with a user's script, for the offline LLM), and torch.distributed's process-wide state
never enters the user's process: two LLMs in one script, or one that uses torch.distributed itself, are no
trouble. The price is one pipe hop of the step's plain data (SchedulerOutput) and its output, tens of
microseconds, against milliseconds of forward.

A rank that dies or fails ends the engine: the executor waits on every local rank's pipe at once, so a dead
process (end of file) or a failure report (rank 0's collective failed or timed out, e.g. because a rank on
another machine died) raises EngineDeadError from `execute` within the process group's timeout at worst, and
the engine core's dead-core path takes over (the server answers 503 and exits 1).
"""
from __future__ import annotations

import copy
import logging
import os
import pickle
import time
import weakref
from multiprocessing.connection import wait

from aserve.config import EngineConfig
from aserve.core.scheduler import SchedulerOutput
from aserve.errors import EngineDeadError, RemoteError
from aserve.worker.distributed import DistributedPlan
from aserve.worker.model_runner import ModelRunnerOutput
from aserve.worker.tp_messages import Failed, Kind, LiveRequests, Message, RankStart, Ready, Result, Shutdown, Step
from aserve.worker.tp_worker import spawn_rank
from aserve.worker.worker import WorkerInfo

log = logging.getLogger("aserve")
REPORT_GRACE_S = 2.0  # after a rank dies, how long rank 0 may take to say what it saw
# how long a rank may take to end after the shutdown; a profiled one (ASERVE_TP_PROFILE) writes its table first
STOP_TIMEOUT_S = 300.0 if os.environ.get("ASERVE_TP_PROFILE") else 10.0


class MultiprocExecutor:
    def __init__(self, config: EngineConfig):
        check_before_spawning(config)
        self.error: EngineDeadError | None = None
        self._tokens: dict[str, list[int]] = {}  # sampled since the last Step, for the ranks that did not sample
        level = logging.getLogger("aserve").getEffectiveLevel()
        rank_config = copy.copy(config)  # the ranks never schedule: a policy class from the user's script (which
        rank_config.policy, rank_config.policy_options = "fcfs", None  # they cannot import) stays here
        self.ranks = self._start_ranks(rank_config, level)
        self._finalizer = weakref.finalize(self, _stop, dict(self.ranks))
        if self.plan.nnodes > 1:
            log.info("tensor parallel: waiting for the ranks of nodes 1..%d at %s", self.plan.nnodes - 1,
                     self.plan.init_method)
        infos = {}
        while len(infos) < len(self.ranks):
            for rank, message in self._next_messages():
                if message.kind is not Kind.READY:
                    self._kill()  # and raise the rank's own error (a bad checkpoint, a missing node, ...), by type
                    raise (message.error.rebuild() if message.kind is Kind.FAILED
                           else EngineDeadError(f"tensor-parallel rank {rank}: {_describe(message)}"))
                infos[rank] = message.info
        self.info: WorkerInfo = infos[0]
        log.info("tensor parallel: %d ranks (%d on this machine) joined at %s", self.plan.world_size,
                 len(self.ranks), self.plan.init_method)

    def _start_ranks(self, config: EngineConfig, log_level: int) -> dict:
        """This machine's ranks, each a process of its own: {rank: (process, its pipe)}; sets self.plan."""
        self.plan = DistributedPlan.for_engine(config)
        return {rank: spawn_rank(RankStart(config, self.plan, rank, local, log_level))
                for rank, local in zip(self.plan.ranks, self.plan.local_ranks)}

    @property
    def worker(self):
        raise AttributeError("with tensor_parallel_size > 1 the model runs in worker processes: there is no "
                             "in-process worker or runner (engine.runner) to inspect")

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        return self.collect()

    def submit(self, sched: SchedulerOutput) -> None:
        """Start a step without waiting for it (pipeline parallelism keeps several in flight); `collect` gives the
        outputs back in the order the steps were submitted."""
        tokens, self._tokens = self._tokens, {}
        self._send(Step(sched, tokens))

    def collect(self) -> ModelRunnerOutput:
        out = self._result()
        self._tokens.update((rid, r.token_ids) for rid, r in out.sampled.items() if r.error is None)
        return out

    def live_request_ids(self) -> list[str]:
        """The requests any rank still holds (each rank's set, merged)."""
        self._send(LiveRequests())
        return sorted(set().union(*self._result()))

    def _send(self, message: Message) -> None:
        if self.error is not None:
            raise self.error
        try:
            self.ranks[0][1].send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            pass  # rank 0 is gone: the wait for its answer says how

    def _result(self):
        """The value of rank 0's next Result; any other word from a rank ends the engine."""
        if self.error is not None:
            raise self.error
        while True:
            for rank, answer in self._next_messages():
                if rank == 0 and answer.kind is Kind.RESULT:
                    return answer.value
                self._die(rank, answer)

    def _next_messages(self) -> list[tuple[int, Ready | Failed | Result]]:
        """(rank, message) for each local rank with something to say; a rank whose pipe ended (its process did)
        reads as Failed with an EngineDeadError that gives its exit status."""
        conns = {id(conn): rank for rank, (_, conn) in self.ranks.items()}
        found = []
        for conn in wait([conn for _, conn in self.ranks.values()]):
            rank = conns[id(conn)]
            try:
                found.append((rank, conn.recv()))
            except (EOFError, OSError):
                try:
                    code = self.ranks[rank][0].wait(timeout=REPORT_GRACE_S)
                except Exception:  # noqa: BLE001 - still alive after closing its pipe
                    code = None
                ended = EngineDeadError(f"tensor-parallel rank {rank} ended (exit status {code})")
                found.append((rank, Failed(RemoteError.of(ended))))
        return found

    def _die(self, rank: int, message: Ready | Failed | Result) -> None:
        """Stop every local rank and raise EngineDeadError naming what each one said or how it ended."""
        reasons = [f"rank {rank}: {_describe(message)}"]
        # The other side's report usually follows, and is worth the wait: a rank's failure makes rank 0's collective
        # fail, and rank 0 failing first (its collective saw a peer's connection drop) is usually followed by the
        # peer's own report or its pipe closing, which names the rank that actually died.
        deadline = time.monotonic() + REPORT_GRACE_S
        for other in ([0] if rank != 0 else [r for r in self.ranks if r != 0]):
            conn = self.ranks[other][1]
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                continue
            try:
                answer = conn.recv()
                if answer.kind is Kind.FAILED:
                    reasons.append(f"rank {other}: {_describe(answer)}")
            except (EOFError, OSError):
                reasons.append(f"rank {other}: ended (its connection closed)")
        self.error = EngineDeadError("a tensor-parallel worker failed; " + "; ".join(reasons))
        log.error("%s", self.error)
        self._kill()
        raise self.error

    def shutdown(self) -> None:
        self._finalizer()

    def _kill(self) -> None:
        """The group is broken: the ranks still running have nothing left to do."""
        self._finalizer.detach()
        _stop(self.ranks, grace=0)


def _describe(message: Ready | Failed | Result) -> str:
    """A rank's word where a Result was due: the error it reported, or the message it should not have sent."""
    if message.kind is Kind.FAILED:
        return message.error.describe()
    return f"an unexpected {message.kind.value} message"


def _stop(ranks: dict, grace: float = STOP_TIMEOUT_S) -> None:
    """Ask rank 0 to broadcast the shutdown, then wait for every local rank, killing one that lingers past
    `grace` seconds."""
    if grace > 0:
        try:
            ranks[0][1].send_bytes(pickle.dumps(Shutdown()))
        except (OSError, KeyError):
            pass
    for proc, conn in ranks.values():
        try:
            proc.wait(grace)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            proc.kill()
            proc.wait()
        conn.close()


def check_before_spawning(config: EngineConfig) -> None:
    """Refuse a model the ranks cannot split before starting any process (config.json alone)."""
    from aserve.models.parallel import check_model, pipeline_stages
    from aserve.models.registry import architecture, model_class, read_config
    from aserve.quantization import resolve

    model_config = read_config(config.model)
    cls = model_class(architecture(model_config))
    check_model(cls, model_config, config.tensor_parallel_size,
                resolve(model_config, config.quantization, config.quantize_lm_head))
    stages = config.pipeline_parallel_size
    if stages > 1:
        if not getattr(cls, "supports_pipeline_parallel", False):
            raise ValueError(f"{cls.__name__} does not support pipeline parallelism yet (pipeline_parallel_size "
                             f"{stages}); the Llama-block families do: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2")
        pipeline_stages(cls.args_from_config(model_config).num_layers, stages, config.pp_layer_partition)
        for on, what in ((config.enable_lora, "LoRA adapters"), (config.speculative_config, "speculative decoding"),
                         (config.resolved_runner == "pooling", "the pooling runner")):
            if on:
                raise ValueError(f"pipeline_parallel_size > 1 with {what} is not supported yet")
