"""The messages between the front end (CoreProcess) and the engine-core child: one struct per message,
each with its kind, so neither side dispatches on command strings or unpacks anonymous tuples.

    parent -> child: Start first; then AddRequest | Abort | GetState (each with a call_id), Shutdown to stop
    child -> parent: Ready | Failed first; then StepOutputs after steps, Result | Error per call_id, Died

They travel pickled over a multiprocessing Connection: their payloads (SamplingParams, RequestOutput,
IterationStats, a policy class given in the config) are Python objects that msgspec does not encode.
Errors travel as RemoteError, so the parent raises the type the core raised.
"""
from __future__ import annotations

import enum
from typing import Any, ClassVar

import msgspec

from aserve.errors import RemoteError


class Kind(enum.Enum):
    START = "start"
    ADD_REQUEST = "add_request"
    ABORT = "abort"
    GET_STATE = "get_state"
    SHUTDOWN = "shutdown"
    READY = "ready"
    FAILED = "failed"
    STEP_OUTPUTS = "step_outputs"
    RESULT = "result"
    ERROR = "error"
    DIED = "died"


class Message(msgspec.Struct, frozen=True):  # subclasses are frozen too
    kind: ClassVar[Kind]


# -- parent -> child --------------------------------------------------------------------------------

class Start(Message):
    kind: ClassVar[Kind] = Kind.START
    config: Any  # EngineConfig


class Call(Message):
    """A message the core answers with a Result or an Error of the same call_id (set by CoreProcess.call)."""
    call_id: int = -1


class AddRequest(Call, kw_only=True):
    kind: ClassVar[Kind] = Kind.ADD_REQUEST
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    request_id: str
    prompt: str | None = None
    priority: int = 0
    arrival_time: float | None = None
    output_kind: str = "delta"
    lora_request: Any = None  # LoRARequest: the adapter it runs under (None: the base model)
    pooling_params: Any = None  # PoolingParams: a pooling request (the pooling runner)


class Abort(Call, kw_only=True):
    """Answered with the aborted requests' final outputs."""
    kind: ClassVar[Kind] = Kind.ABORT
    request_ids: list[str]


class GetState(Call, kw_only=True):
    """Answered with EngineCore.state(): free blocks, queues, live requests (counters, cheap to poll);
    `diagnostics` adds the core's heap and Python object counts (costly, so measured at most every few seconds)."""
    kind: ClassVar[Kind] = Kind.GET_STATE
    diagnostics: bool = False


class Shutdown(Message):
    kind: ClassVar[Kind] = Kind.SHUTDOWN


# -- child -> parent --------------------------------------------------------------------------------

class Ready(Message):
    kind: ClassVar[Kind] = Kind.READY
    facts: Any  # EngineFacts


class Failed(Message):
    """The core could not start."""
    kind: ClassVar[Kind] = Kind.FAILED
    error: RemoteError


class StepOutputs(Message):
    kind: ClassVar[Kind] = Kind.STEP_OUTPUTS
    outputs: list  # RequestOutput, one per request that advanced
    stats: Any = None  # IterationStats, when anything happened


class Result(Message):
    kind: ClassVar[Kind] = Kind.RESULT
    call_id: int
    value: Any = None


class Error(Message):
    """The call was refused (bad input, a full queue); the core goes on."""
    kind: ClassVar[Kind] = Kind.ERROR
    call_id: int
    error: RemoteError


class Died(Message):
    """The core's loop raised: it is going away."""
    kind: ClassVar[Kind] = Kind.DIED
    error: RemoteError
