"""A rank's process (tensor and pipeline parallelism): `python -m aserve.worker.tp_worker FD` (started by the
multi-process executor, or by `aserve worker` on the other machines), and the loop every rank runs.

Every rank runs the same loop: rank 0 takes the next message (a typed struct of tp_messages) from the executor's
pipe and broadcasts it over its tensor-parallel group; every rank then runs it. A step is a forward on every rank
(the model's own all-reduces and the logits gather inside it) and sampling on one rank alone, which answers the
executor; a Step carries the tokens sampled in the steps answered since the last one (the executor adds them), and
every other rank appends them, so every rank's requests hold the same tokens with no extra collective. With
pipeline stages, each stage hands the message and then its hidden states to the next one (see `serve`); the last
stage samples. While the engine is idle rank 0 broadcasts a Noop every HEARTBEAT_S, so the other ranks' wait for
the next step never reaches the collective timeout, and a dead rank is noticed even when nothing runs.

Started with `-m` rather than multiprocessing's spawn (as the engine-core process is), so a user's script without
a `__main__` guard is never imported again in the ranks.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, wait
from pathlib import Path

import msgspec
import torch

from aserve.errors import RemoteError
from aserve.process_exit import exit_now
from aserve.worker.distributed import (DistributedPlan, PipelineLinks, broadcast_bytes, rank_device, rendezvous,
                                      threads_per_rank)
from aserve.worker.tp_messages import (Failed, Kind, Message, Noop, RankFacts, RankStart, RankStatus, Ready, Result,
                                       Shutdown)

log = logging.getLogger("aserve")
HEARTBEAT_S = 5.0  # at most; a third of the collective timeout when that is shorter
NOOP, SHUTDOWN = pickle.dumps(Noop()), pickle.dumps(Shutdown())  # what rank 0 broadcasts of its own accord
SEND_LOCK = threading.Lock()  # rank 0 answers the executor from its loop and, in a pipeline, from ResultForwarder


def spawn_rank(start: RankStart) -> tuple[subprocess.Popen, Connection]:
    """Start one rank's process; the returned pipe carries its start message, its answer (Ready or Failed),
    and, for rank 0, the steps. Its end of file means the process ended."""
    if not start.threads:  # a share of ours
        start = msgspec.structs.replace(start, threads=threads_per_rank(start.plan.ranks_per_node))
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "aserve.worker.tp_worker", str(theirs.fileno()),
                             f"--rank={start.rank}"],  # for ps and tests; the rank itself comes with `start`
                            pass_fds=[theirs.fileno()])
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(start)
    return proc, conn


def run_rank(start: RankStart, conn: Connection | None) -> int:
    """Load this rank's slices, join the group, then serve steps until shutdown. Returns the exit status."""
    from aserve.models.parallel import TensorParallel
    from aserve.ops import cpu_kernels
    from aserve.worker.worker import Worker

    logging.getLogger("aserve").setLevel(start.log_level)
    config, plan = start.config, start.plan
    torch.set_num_threads(start.threads or threads_per_rank(plan.ranks_per_node))
    torch.manual_seed(config.seed)  # one rank samples: the same random stream as one rank in the engine's process
    size = config.tensor_parallel_size
    pipe = PipelineLinks(start.rank, size, config.pipeline_parallel_size)
    tp = TensorParallel(pipe.tp_rank, size)
    worker, error = None, None
    try:
        device = rank_device(config.device, start.local_rank)
        stage, most = pipeline_stage(config, pipe)
        worker = Worker(config, tp, device, stage, most)
        if device.type == "cpu":  # now, not in the first forward: a first build (10-30 s) there would keep the
            cpu_kernels.available()  # other ranks waiting in a collective, towards its timeout
        i = worker.info
        status = RankStatus(facts=RankFacts(i.model_class, i.dtype, i.kv_cache_dtype, i.num_blocks,
                                            i.num_host_blocks, i.vocab_size, config.block_size))
    except Exception as exc:  # noqa: BLE001 - every rank hears of it at the rendezvous
        device, error, status = torch.device("cpu"), exc, RankStatus(error=f"{type(exc).__name__}: {exc}")
    try:
        rendezvous(plan, tp, device, status, pipe)
        if error is not None:
            raise error
    except Exception as exc:  # noqa: BLE001
        return _fail(conn, start.rank, exc)
    if conn is not None:
        conn.send(Ready(worker.info))
    log.info("rank %d of %d (pipeline stage %d, tensor-parallel rank %d) ready (%s, %d threads)", pipe.rank,
             plan.world_size, pipe.stage, tp.rank, device, torch.get_num_threads())
    try:
        with profiled(pipe.rank):
            serve(worker, tp, conn, plan.timeout_s, pipe)
    except Exception as exc:  # noqa: BLE001 - a collective failed or timed out: this rank is done
        _fail(conn, start.rank, exc)
        os._exit(1)  # not through the process group's teardown, which may wait on the ranks that are gone
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def _fail(conn: Connection | None, rank: int, exc: BaseException) -> int:
    log.error("tensor-parallel rank %d: %s: %s", rank, type(exc).__name__, exc)
    if conn is not None:
        try:
            with SEND_LOCK:
                conn.send(Failed(RemoteError.of(exc)))
        except OSError:
            pass
    return 1


def pipeline_stage(config, pipe: PipelineLinks):
    """This rank's pipeline stage and the layer count of the largest stage (by which every stage counts its KV
    blocks, so they all have as many); (None, None) without pipeline parallelism."""
    if pipe.num_stages == 1:
        return None, None
    from aserve.models.parallel import pipeline_stages
    from aserve.models.registry import architecture, model_class, read_config

    model_config = read_config(config.model)
    num_layers = model_class(architecture(model_config)).args_from_config(model_config).num_layers
    stages = pipeline_stages(num_layers, pipe.num_stages, config.pp_layer_partition)
    return stages[pipe.stage], max(len(s.layers(num_layers)) for s in stages)


def serve(worker, tp, conn: Connection | None, timeout_s: float, pipe: PipelineLinks) -> None:
    """The step loop (see the module docstring). Returns on shutdown; raises when a collective fails.

    With pipeline stages, the first stage's ranks take each message as above; every stage hands it on (the
    same bytes) to the same tensor-parallel rank of the next stage, then, for a step, its hidden states once it
    has run its layers, and goes on to the next message: up to one step per stage is in flight. The last stage
    samples (its tensor-parallel rank 0) and sends each output to rank 0, where a thread answers the executor."""
    import torch.distributed as dist

    heartbeat = min(HEARTBEAT_S, timeout_s / 3)
    rank0 = pipe.rank == 0
    answers = ResultForwarder(conn, pipe) if rank0 and not pipe.samples else None
    while True:
        if pipe.first:
            parts = None
            if rank0:  # the executor's message goes on as the bytes it came in: pickled once, by the executor
                try:
                    raw = conn.recv_bytes() if conn.poll(heartbeat) else NOOP
                except (EOFError, OSError):  # the engine is gone: take the others down with us, cleanly
                    raw = SHUTDOWN
                parts = [raw]
            (raw,) = broadcast_bytes(parts, tp, count=1)
        else:
            (raw,) = pipe.recv_bytes(1, pipe.rank - pipe.tp_size)
        if not pipe.last:
            pipe.send_bytes([raw], pipe.rank + pipe.tp_size)
        message: Message = pickle.loads(raw)
        if message.kind is Kind.NOOP:
            continue
        if message.kind is Kind.SHUTDOWN:
            pipe.flush()
            return
        if message.kind is Kind.STEP:
            if not pipe.samples:
                worker.runner.append_sampled(message.tokens)
            runs = bool(message.sched.num_scheduled_tokens)  # else only block copies and finished requests
            intermediate = pipe.recv_hidden() if runs and not pipe.first else None
            with torch.profiler.record_function("aserve.step"):  # one per step, for the profiler's table
                out = worker.execute(message.sched, intermediate)
            if runs and not pipe.last:
                pipe.send_hidden(out.intermediate)
            if pipe.samples:
                if rank0:
                    _reply(conn, out)
                else:
                    pipe.send_result(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
            elif answers is not None:
                answers.expect()
        elif message.kind is Kind.LIVE_REQUESTS:  # every rank's, so a test can see that they agree
            ids = sorted(worker.runner.requests)
            gathered = [None] * pipe.num_stages * tp.size if rank0 else None
            dist.gather_object(ids, gathered, dst=0, group=pipe.cpu_group)
            if rank0:
                _reply(conn, gathered)
        else:
            raise TypeError(f"rank {pipe.rank} got a message it does not serve: {message!r}")


class ResultForwarder:
    """Rank 0 of a pipeline: a thread that takes each step's output from the last stage's sampling rank (on a
    group of its own) and answers the executor, while the main loop already feeds the next step to stage 0. A
    failure (the last stage died, or timed out) is reported to the executor like the main loop's, and ends the
    process."""

    def __init__(self, conn: Connection, pipe: PipelineLinks):
        self.conn, self.pipe = conn, pipe
        self.pending = threading.Semaphore(0)
        threading.Thread(target=self._run, name="aserve-results", daemon=True).start()

    def expect(self) -> None:
        """One more step is on its way through the pipeline: its output will come."""
        self.pending.release()

    def _run(self) -> None:
        try:
            while True:
                self.pending.acquire()
                out = pickle.loads(self.pipe.recv_result())
                _reply(self.conn, out)
        except Exception as exc:  # noqa: BLE001 - the pipeline is broken: say so, then end the rank
            _fail(self.conn, self.pipe.rank, exc)
            os._exit(1)


@contextlib.contextmanager
def profiled(rank: int):
    """ASERVE_TP_PROFILE=DIR: record the rank's step loop with torch.profiler and write DIR/rank<N>.txt at
    shutdown: the op table, where gloo's all_reduce and gather rows against `aserve.step`'s count give what the
    collectives cost per step."""
    folder = os.environ.get("ASERVE_TP_PROFILE")
    if not folder:
        yield
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    (Path(folder) / f"rank{rank}.txt").write_text(table)


def _reply(conn: Connection, value) -> None:
    try:
        with SEND_LOCK:
            conn.send(Result(value))
    except OSError:
        pass  # the engine is gone; the next recv says so


# -- `aserve worker`: a machine that runs ranks only --------------------------------------------------

def run_node(config, log_level: int = logging.INFO) -> int:
    """Start this machine's ranks of a multi-node job and wait for them; the exit status is 0 when they all
    ended cleanly (the engine shut down), else 1."""
    plan = DistributedPlan.for_node(config)
    log.info("node %d of %d: ranks %s of %d, rendezvous at %s", plan.node_rank, plan.nnodes, list(plan.ranks),
             plan.world_size, plan.init_method)
    if len(plan.ranks) == 1 and "RANK" in os.environ:  # a launcher started this very process as the rank
        return run_rank(RankStart(config, plan, plan.ranks[0], plan.local_ranks[0], log_level), None)
    procs = {rank: spawn_rank(RankStart(config, plan, rank, local, log_level))
             for rank, local in zip(plan.ranks, plan.local_ranks)}
    status = 0
    try:
        pending = dict(procs)
        while pending:
            for conn in wait([c for _, c in pending.values()]):
                rank = next(r for r, (_, c) in pending.items() if c is conn)
                try:
                    message: Ready | Failed = conn.recv()
                    if message.kind is Kind.FAILED:
                        log.error("rank %d failed: %s", rank, message.error.describe())
                    continue
                except (EOFError, OSError):
                    proc, _ = pending.pop(rank)
                    code = proc.wait()
                    if code != 0:
                        log.error("rank %d exited with status %d", rank, code)
                        status = 1
    finally:
        for proc, conn in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            conn.close()
    return status


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    try:
        start: RankStart = conn.recv()
    except EOFError:
        sys.exit(1)
    code = run_rank(start, conn)
    conn.close()
    exit_now(code)  # nothing in the interpreter's teardown is needed once the process group is destroyed


if __name__ == "__main__":
    main()
