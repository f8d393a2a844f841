"""The messages of the tensor-parallel channel: one struct per message, each with its kind, in the style of
engine/messages.py, so neither end dispatches on command strings or unpacks anonymous tuples.

    starter -> rank (its pipe):          RankStart first
    executor -> rank 0 -> every rank:    Step | LiveRequests | Shutdown (rank 0 broadcasts them, and Noop while idle)
    rank -> its starter:                 Ready | Failed first; rank 0 then a Result per Step or LiveRequests,
                                         or Failed when a collective fails

They travel pickled (a multiprocessing Connection; the broadcast's bytes): their payloads (EngineConfig,
SchedulerOutput, ModelRunnerOutput, WorkerInfo) are Python objects that msgspec does not encode. Errors travel as
RemoteError, so the starter raises the type the rank raised. What every rank publishes at the rendezvous
(RankStatus) is msgspec JSON, in the process group's TCPStore.
"""
from __future__ import annotations

import enum
import logging
from typing import Any, ClassVar

import msgspec

from aserve.errors import RemoteError


class Kind(enum.Enum):
    START = "start"
    STEP = "step"
    LIVE_REQUESTS = "live_requests"
    NOOP = "noop"
    SHUTDOWN = "shutdown"
    READY = "ready"
    FAILED = "failed"
    RESULT = "result"


class Message(msgspec.Struct, frozen=True):  # subclasses are frozen too
    kind: ClassVar[Kind]


# -- to the ranks ---------------------------------------------------------------------------------------

class RankStart(Message):
    """What a rank's process is told first, over its pipe."""
    kind: ClassVar[Kind] = Kind.START
    config: Any  # EngineConfig
    plan: Any  # worker.distributed.DistributedPlan
    rank: int
    local_rank: int
    log_level: int = logging.INFO
    threads: int = 0  # torch threads; 0: this process's share (distributed.threads_per_rank)


class Step(Message):
    """Run one step; rank 0 answers with a Result holding the ModelRunnerOutput. `tokens`: what the sampling rank
    sampled in the steps answered since the last Step (request id -> tokens), for every other rank to append."""
    kind: ClassVar[Kind] = Kind.STEP
    sched: Any  # core.scheduler.SchedulerOutput
    tokens: dict = {}


class LiveRequests(Message):
    """Rank 0 answers with a Result holding every rank's live request ids (a list per rank)."""
    kind: ClassVar[Kind] = Kind.LIVE_REQUESTS


class Noop(Message):
    """Rank 0's heartbeat while the engine is idle: the other ranks' wait never reaches the collective timeout."""
    kind: ClassVar[Kind] = Kind.NOOP


class Shutdown(Message):
    kind: ClassVar[Kind] = Kind.SHUTDOWN


# -- from the ranks -------------------------------------------------------------------------------------

class Ready(Message):
    kind: ClassVar[Kind] = Kind.READY
    info: Any  # worker.worker.WorkerInfo


class Failed(Message):
    """The rank could not start, or its step loop failed (a collective timed out): it is going away."""
    kind: ClassVar[Kind] = Kind.FAILED
    error: RemoteError


class Result(Message):
    kind: ClassVar[Kind] = Kind.RESULT
    value: Any = None


# -- at the rendezvous ----------------------------------------------------------------------------------

class RankFacts(msgspec.Struct, frozen=True):
    """What every rank of one job must agree on: a node started with other options is refused by name."""
    model_class: str
    dtype: str
    kv_cache_dtype: str
    num_blocks: int
    num_host_blocks: int
    vocab_size: int
    block_size: int


class RankStatus(msgspec.Struct, frozen=True):
    """One rank's word at the rendezvous: its facts, or why it could not load."""
    facts: RankFacts | None = None
    error: str | None = None
