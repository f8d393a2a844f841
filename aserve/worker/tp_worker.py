"""A tensor-parallel rank's process: `python -m aserve.worker.tp_worker FD` (started by the multi-process executor,
or by `aserve worker` on the other machines), and the loop every rank runs.

Every rank runs the same loop: rank 0 takes the next message (a typed struct of tp_messages) from the executor's
pipe and broadcasts it (with the tokens it sampled last step) over the gloo group; every rank then runs it. A step
is a forward on every rank (the model's own all-reduces and the logits gather inside it) and sampling on rank 0
alone, which answers the executor; the other ranks append rank 0's tokens when the next message arrives, so every
rank's requests hold the same tokens with no extra collective. While the engine is idle rank 0 broadcasts a Noop
every HEARTBEAT_S, so the other ranks' wait for the next step never reaches the collective timeout, and a dead rank
is noticed even when nothing runs.

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
from multiprocessing.connection import Connection, wait
from pathlib import Path

import msgspec
import torch

from aserve.errors import RemoteError
from aserve.worker.distributed import DistributedPlan, broadcast_bytes, rank_device, rendezvous, threads_per_rank
from aserve.worker.tp_messages import (Failed, Kind, Message, Noop, RankFacts, RankStart, RankStatus, Ready, Result,
                                       Shutdown)

log = logging.getLogger("aserve")
HEARTBEAT_S = 5.0  # at most; a third of the collective timeout when that is shorter
NOOP, SHUTDOWN = pickle.dumps(Noop()), pickle.dumps(Shutdown())  # what rank 0 broadcasts of its own accord


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
    torch.manual_seed(config.seed)  # rank 0 samples: the same random stream as one rank in the engine's process
    tp = TensorParallel(start.rank, plan.world_size)
    worker, error = None, None
    try:
        device = rank_device(config.device, start.local_rank)
        worker = Worker(config, tp, device)
        if device.type == "cpu":  # now, not in the first forward: a first build (10-30 s) there would keep the
            cpu_kernels.available()  # other ranks waiting in a collective, towards its timeout
        i = worker.info
        status = RankStatus(facts=RankFacts(i.model_class, i.dtype, i.kv_cache_dtype, i.num_blocks,
                                            i.num_host_blocks, i.vocab_size, config.block_size))
    except Exception as exc:  # noqa: BLE001 - every rank hears of it at the rendezvous
        device, error, status = torch.device("cpu"), exc, RankStatus(error=f"{type(exc).__name__}: {exc}")
    try:
        rendezvous(plan, tp, device, status)
        if error is not None:
            raise error
    except Exception as exc:  # noqa: BLE001
        return _fail(conn, start.rank, exc)
    if conn is not None:
        conn.send(Ready(worker.info))
    log.info("tensor-parallel rank %d of %d ready (%s, %d threads)", tp.rank, tp.size, device,
             torch.get_num_threads())
    try:
        with profiled(tp.rank):
            serve(worker, tp, conn, plan.timeout_s)
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
            conn.send(Failed(RemoteError.of(exc)))
        except OSError:
            pass
    return 1


def serve(worker, tp, conn: Connection | None, timeout_s: float) -> None:
    """The step loop (see the module docstring). Returns on shutdown; raises when a collective fails."""
    import torch.distributed as dist

    sampled: dict[str, int] = {}  # rank 0: the tokens of its last step, not yet sent to the other ranks
    heartbeat = min(HEARTBEAT_S, timeout_s / 3)
    while True:
        parts = None
        if tp.rank == 0:  # the executor's message goes on as the bytes it came in: pickled once, by the executor
            try:
                raw = conn.recv_bytes() if conn.poll(heartbeat) else NOOP
            except (EOFError, OSError):  # the engine is gone: take the others down with us, cleanly
                raw = SHUTDOWN
            parts = [pickle.dumps(sampled), raw]
            sampled = {}
        tokens, raw = broadcast_bytes(parts, tp)
        message: Message = pickle.loads(raw)
        if tp.rank != 0:
            worker.runner.append_sampled(pickle.loads(tokens))
        if message.kind is Kind.NOOP:
            continue
        if message.kind is Kind.SHUTDOWN:
            return
        if message.kind is Kind.STEP:
            with torch.profiler.record_function("aserve.step"):  # one per step, for the profiler's table
                out = worker.execute(message.sched)
            if tp.rank == 0:
                sampled = {rid: r.token_ids for rid, r in out.sampled.items() if r.error is None}
                _reply(conn, out)
        elif message.kind is Kind.LIVE_REQUESTS:  # every rank's, so a test can see that they agree
            ids = sorted(worker.runner.requests)
            gathered = [None] * tp.size if tp.rank == 0 else None
            dist.gather_object(ids, gathered, dst=0, group=tp.cpu_group)
            if tp.rank == 0:
                _reply(conn, gathered)
        else:
            raise TypeError(f"tensor-parallel rank {tp.rank} got a message it does not serve: {message!r}")


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
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: with torch and a model loaded it took over a second per rank (measured),
    # and nothing in it is needed once the process group is destroyed.
    os._exit(code)


if __name__ == "__main__":
    main()
