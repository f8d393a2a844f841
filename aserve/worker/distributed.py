"""Where the tensor-parallel ranks run and how they meet: the plan (world size, which ranks this machine starts,
the rendezvous address) from the engine options or torchrun's environment variables, the rendezvous itself on
torch.distributed (a TCPStore, then the process group: gloo on the CPU, NCCL on CUDA), and the one collective
the step loop adds: rank 0 broadcasting each step's bytes.

Two timeouts, because they bound different waits. Joining waits for the other machines to be started and to
load their slices (RENDEZVOUS_TIMEOUT_S, long: a person may start node 1 a minute after node 0). Every collective
after that waits at most `distributed_timeout` seconds, so a hung or unreachable rank ends the engine instead of
hanging it; a rank that dies is seen at once (gloo's connection closes).
"""
from __future__ import annotations

import logging
import os
import re
import socket
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import msgspec
import torch

from aserve.models.parallel import TensorParallel
from aserve.worker.tp_messages import RankStatus

log = logging.getLogger("aserve")
RENDEZVOUS_TIMEOUT_S = 600.0
TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistributedPlan:
    """One machine's share of a tensor-parallel job: ranks node_rank * per_node ... are its own."""
    world_size: int
    nnodes: int
    node_rank: int
    host: str
    port: int
    timeout_s: float
    ranks: tuple[int, ...]  # the ranks this machine starts
    local_ranks: tuple[int, ...]  # and their index on this machine (the GPU each one uses)
    ranks_per_node: int  # for the threads of each rank

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @classmethod
    def for_engine(cls, config, env: Mapping[str, str] = os.environ) -> "DistributedPlan":
        """The engine's machine (node 0): ranks 0 .. world/nnodes - 1, rank 0 being the one that samples."""
        if config.node_rank != 0:
            raise ValueError(f"node_rank {config.node_rank}: the engine runs on node 0; the other nodes run "
                             "`aserve worker --node-rank R ...` (workers only)")
        return cls._plan(config, env, node_rank=0)

    @classmethod
    def for_node(cls, config, env: Mapping[str, str] = os.environ) -> "DistributedPlan":
        """A machine of workers only (`aserve worker`): its node's ranks, or with torchrun's RANK, WORLD_SIZE and
        LOCAL_RANK set, exactly that one rank (a launcher that starts each rank itself)."""
        if "RANK" in env:
            world = int(env.get("WORLD_SIZE", config.world_size))
            if world != config.world_size:
                raise ValueError(f"WORLD_SIZE={world} but tensor_parallel_size x pipeline_parallel_size is "
                                 f"{config.world_size}: the ranks of one job are its model's group")
            rank = int(env["RANK"])
            if not 0 < rank < world:
                raise ValueError(f"RANK={rank}: a worker-only process holds a rank in 1..{world - 1} (rank 0 is the "
                                 "engine's)")
            plan = cls._plan(config, env, node_rank=config.node_rank)
            local = int(env.get("LOCAL_RANK", rank % plan.ranks_per_node))
            return cls(plan.world_size, plan.nnodes, plan.node_rank, plan.host, plan.port, plan.timeout_s, (rank,),
                       (local,), plan.ranks_per_node)
        if config.nnodes == 1:
            raise ValueError("`aserve worker` runs the ranks of another machine of a multi-node group: pass --nnodes "
                             "K (> 1) and --node-rank R (1..K-1), or set RANK as a launcher does; one machine needs "
                             "no worker command (`aserve --tensor-parallel-size N` starts its ranks)")
        if not 0 < config.node_rank < config.nnodes:
            raise ValueError(f"node_rank must be in 1..{config.nnodes - 1} for `aserve worker` (node 0 runs the "
                             f"engine), got {config.node_rank} with nnodes {config.nnodes}")
        return cls._plan(config, env, node_rank=config.node_rank)

    @classmethod
    def _plan(cls, config, env: Mapping[str, str], node_rank: int) -> "DistributedPlan":
        world, nnodes = config.world_size, config.nnodes
        if world % nnodes:
            raise ValueError(f"{world} ranks (tensor x pipeline parallel) do not split evenly over nnodes {nnodes}")
        method = config.distributed_init_method
        if method is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            method = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        if method is None:
            if nnodes > 1:
                raise ValueError(f"nnodes {nnodes} needs a rendezvous address every node can reach: "
                                 "--distributed-init-method tcp://HOST:PORT (HOST: node 0), or MASTER_ADDR and "
                                 "MASTER_PORT")
            method = f"tcp://127.0.0.1:{free_port()}"
        host, port = parse_init_method(method)
        per_node = world // nnodes
        ranks = tuple(range(node_rank * per_node, (node_rank + 1) * per_node))
        return cls(world, nnodes, node_rank, host, port, float(config.distributed_timeout), ranks,
                   tuple(range(per_node)), per_node)


def parse_init_method(method: str) -> tuple[str, int]:
    m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:([0-9]+)", method.strip())
    if not m:
        raise ValueError(f"distributed_init_method must be tcp://HOST:PORT, got {method!r}")
    return m.group(1), int(m.group(2))


def free_port() -> int:
    """A port free on the loopback now (a single machine's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(ranks_on_this_machine: int) -> int:
    """The threads of the process that starts the ranks (torch's default: the cores it may use; a data-parallel
    replica's share), split between the machine's ranks so they do not oversubscribe the cores."""
    return max(1, torch.get_num_threads() // ranks_on_this_machine)


def rank_device(option: str, local_rank: int) -> torch.device:
    """A rank's device: the CPU, or the GPU of its index on this machine."""
    if option == "cpu" or (option == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if option not in ("auto", "cuda"):
        raise ValueError(f"device {option!r}: with tensor parallelism each rank takes cuda:LOCAL_RANK; pass "
                         "device cuda (or auto), and CUDA_VISIBLE_DEVICES to choose the GPUs")
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank needs GPU {local_rank}, but torch sees {torch.cuda.device_count()} here")
    return torch.device("cuda", local_rank)


# -- the rendezvous --------------------------------------------------------------------------------------

def rendezvous(plan: DistributedPlan, tp: TensorParallel, device: torch.device, status: RankStatus,
               pipe: "PipelineLinks | None" = None) -> None:
    """Meet the other ranks and join the process group. Every rank first publishes `status` (its load error,
    or the facts every rank must share: KV blocks, model class, dtype) in the TCPStore, then reads all of them,
    so a rank that could not load, or a node started with other options, fails every rank with one clear
    message instead of a timeout. With pipeline stages (`pipe`), each stage's ranks get a tensor-parallel group
    of their own, and `pipe` the world's groups for its point-to-point traffic."""
    import torch.distributed as dist

    rank = pipe.rank if pipe is not None else tp.rank
    store = dist.TCPStore(plan.host, plan.port, plan.world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S), wait_for_workers=False)
    keys = [f"aserve/rank/{r}" for r in range(plan.world_size)]
    store.set(keys[rank], msgspec.json.encode(status))
    try:
        store.wait(keys, timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - say which ranks are missing
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TimeoutError(f"tensor-parallel ranks {missing} did not join at {plan.init_method} within "
                           f"{RENDEZVOUS_TIMEOUT_S:.0f} s: start `aserve worker --node-rank R ...` on the other "
                           "nodes, with the same model and options") from None
    statuses = [msgspec.json.decode(store.get(key), type=RankStatus) for key in keys]
    for r, s in enumerate(statuses):
        if s.error is not None and r != rank:
            raise RuntimeError(f"tensor-parallel rank {r} could not load the model: {s.error}")
    if status.error is not None:
        return  # the caller raises its own error
    for r, s in enumerate(statuses):
        if s.facts != statuses[0].facts:
            raise ValueError(f"tensor-parallel rank {r} differs from rank 0 ({s.facts} against "
                             f"{statuses[0].facts}): start every node with the same model and options "
                             "(--kv-cache-memory, --block-size, --dtype, ...)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=plan.timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=plan.world_size, timeout=timeout,
                            **({"device_id": device} if backend == "nccl" else {}))
    world_cpu = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    if pipe is None or pipe.num_stages == 1:
        tp.group, tp.cpu_group = dist.group.WORLD, world_cpu
    else:  # every rank makes every stage's groups, in the same order, as new_group requires
        for stage in range(pipe.num_stages):
            ranks = list(range(stage * tp.size, (stage + 1) * tp.size))
            group = dist.new_group(ranks=ranks, timeout=timeout)
            cpu_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout) if backend == "nccl" else group
            if stage == pipe.stage:
                tp.group, tp.cpu_group = group, cpu_group
    if pipe is not None:
        pipe.group, pipe.cpu_group, pipe.device = dist.group.WORLD, world_cpu, device
        if pipe.num_stages > 1:  # the outputs' way back to rank 0, used by a thread of its own there
            pipe.results_group = dist.new_group(backend="gloo", timeout=timeout)
    log.debug("rank %d of %d joined at %s (%s)", rank, plan.world_size, plan.init_method, backend)


class PipelineLinks:
    """A rank's place in the pipeline and its point-to-point traffic: the step's bytes and the hidden states from
    the same tensor-parallel rank of the stage before, to that of the stage after; the last stage's sampling
    rank sends the step's output back to rank 0, which answers the engine. (Set up by `rendezvous`.)"""

    def __init__(self, rank: int, tp_size: int, num_stages: int):
        self.rank, self.tp_size, self.num_stages = rank, tp_size, num_stages
        self.stage, self.tp_rank = divmod(rank, tp_size)
        self.group = self.cpu_group = self.results_group = None
        self.device = torch.device("cpu")
        self.pending: deque = deque()  # sends on their way: (work, tensor)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def samples(self) -> bool:
        """The rank that samples: tensor-parallel rank 0 of the last stage."""
        return self.last and self.tp_rank == 0

    @property
    def sampler_rank(self) -> int:
        return (self.num_stages - 1) * self.tp_size

    def _send(self, tensor: torch.Tensor, dst: int, group) -> None:
        """Send without waiting for the receiver: gloo's send completes only once the other side has posted its
        receive, and the next stage posts it only when it is done with the batch before, so a blocking send would
        keep the two stages from ever running at once. The tensor is kept until its send completes (in order:
        sends to one rank on one group arrive in the order they were made)."""
        import torch.distributed as dist

        self.pending.append((dist.isend(tensor, dst, group=group), tensor))
        while self.pending and (len(self.pending) > MAX_PENDING_SENDS or self.pending[0][0].is_completed()):
            self.pending.popleft()[0].wait()

    def flush(self) -> None:
        """Wait for every send still on its way (before the process group goes)."""
        while self.pending:
            self.pending.popleft()[0].wait()

    def send_bytes(self, parts: list[bytes], dst: int) -> None:
        self._send(torch.tensor([len(p) for p in parts], dtype=torch.int64), dst, self.cpu_group)
        self._send(torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8), dst, self.cpu_group)

    def recv_bytes(self, count: int, src: int) -> list[bytes]:
        import torch.distributed as dist

        sizes = torch.empty(count, dtype=torch.int64)
        dist.recv(sizes, src, group=self.cpu_group)
        lengths = sizes.tolist()
        buffer = torch.empty(sum(lengths), dtype=torch.uint8)
        dist.recv(buffer, src, group=self.cpu_group)
        data, out, at = buffer.numpy().tobytes(), [], 0
        for n in lengths:
            out.append(data[at:at + n])
            at += n
        return out

    def send_result(self, data: bytes) -> None:
        """The sampling rank: a step's pickled output to rank 0."""
        self._send(torch.tensor([len(data)], dtype=torch.int64), 0, self.results_group)
        self._send(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, self.results_group)

    def recv_result(self) -> bytes:
        import torch.distributed as dist

        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, self.sampler_rank, group=self.results_group)
        buffer = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(buffer, self.sampler_rank, group=self.results_group)
        return buffer.numpy().tobytes()

    def send_hidden(self, tensors: tuple) -> None:
        """To the next stage: how many tensors, their shape and dtype, then each (all of one shape)."""
        import torch.distributed as dist

        first = tensors[0]
        header = torch.tensor([len(tensors), *first.shape, DTYPE_CODES.index(first.dtype)], dtype=torch.int64)
        self._send(header, self.rank + self.tp_size, self.cpu_group)
        for t in tensors:
            self._send(t.contiguous(), self.rank + self.tp_size, self.group)

    def recv_hidden(self) -> tuple:
        import torch.distributed as dist

        header = torch.empty(4, dtype=torch.int64)
        dist.recv(header, self.rank - self.tp_size, group=self.cpu_group)
        count, rows, cols, code = header.tolist()
        out = []
        for _ in range(count):
            t = torch.empty(rows, cols, dtype=DTYPE_CODES[code], device=self.device)
            dist.recv(t, self.rank - self.tp_size, group=self.group)
            out.append(t)
        return tuple(out)


DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16]
MAX_PENDING_SENDS = 16  # then the oldest is waited for: a stage runs ahead of the next by a few batches at most


# -- the step loop's collective ------------------------------------------------------------------------

def broadcast_bytes(parts: list[bytes] | None, tp: TensorParallel, count: int = 2) -> list[bytes]:
    """Rank 0's `count` byte strings, on every rank: their lengths, then their concatenation (two broadcasts on
    the gloo group). Other ranks pass None."""
    import torch.distributed as dist

    root = tp.rank == 0
    sizes = torch.tensor([len(p) for p in parts] if root else [0] * count, dtype=torch.int64)
    dist.broadcast(sizes, 0, group=tp.cpu_group)
    lengths = sizes.tolist()
    if root:
        buffer = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    else:
        buffer = torch.empty(sum(lengths), dtype=torch.uint8)
    dist.broadcast(buffer, 0, group=tp.cpu_group)
    if root:
        return parts
    data, out, at = buffer.numpy().tobytes(), [], 0
    for n in lengths:
        out.append(data[at:at + n])
        at += n
    return out
