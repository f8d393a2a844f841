"""The scheduling-policy seam: the decisions the scheduler delegates, and the loader that finds them.

A policy never touches memory. It orders the waiting queue, picks whom to preempt when blocks run out
and how (recompute or swap), and may hear about request events. Built-ins live in the separate
`aserve-policies` distribution and register under the entry-point group `aserve.policies`,
exactly as a third party's policy does.
"""
from __future__ import annotations

import enum
import importlib.metadata
import inspect
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from aserve.errors import PolicyLoadError
from aserve.plugins import PluginKind

if TYPE_CHECKING:  # annotations only: resolving a policy must not import torch (see resolve_policy)
    from aserve.request import Request

ENTRY_POINT_GROUP = "aserve.policies"


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True)
class KVView:
    """What a policy may know of memory: free and total blocks, on the device and in the host pool."""
    num_free_device_blocks: int
    num_device_blocks: int
    num_free_host_blocks: int
    num_host_blocks: int
    block_size: int


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class KeyedQueue:
    """Waiting requests served smallest key first; the key is computed when asked, so it may change with
    time (aging). Preempted requests simply go back in: their key puts them where they belong."""

    def __init__(self, key: Callable[[Request], tuple]):
        self.key = key
        self._items: list[Request] = []

    def add(self, req: Request) -> None:
        self._items.append(req)

    prepend = add

    def peek(self) -> Request:
        return min(self._items, key=self.key)

    def pop(self) -> Request:
        req = self.peek()
        self._items.remove(req)
        return req

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._items, key=self.key))


class Policy:
    """Base class of scheduling policies; override what you decide differently.

    A policy is constructed with the keyword options given as `policy_options` (`--policy-option K=V`)."""

    name: str = "base"
    description: str = ""
    priority_classes: bool = False  # True: latency metrics are labelled with each request's priority
    # With LoRA on, the scheduler sets this to --max-loras: the most distinct adapters (request.lora) in one step,
    # which it enforces itself; a policy may use it to order its queue. None: LoRA is off.
    max_loras: int | None = None

    def waiting_queue(self) -> FCFSQueue:
        return FCFSQueue()

    def select_victim(self, running: Sequence[Request], needing: Request) -> Request | None:
        """Whom to preempt so that `needing` can get blocks (it may be `needing` itself); None = `needing`."""
        raise NotImplementedError

    def preemption_mode(self, victim: Request, kv_view: KVView) -> PreemptionMode:
        return PreemptionMode.RECOMPUTE

    def should_preempt_for(self, waiting: Request, running: Sequence[Request]) -> Request | None:
        """Optionally let an urgent waiting request displace a running one."""
        return None

    def on_event(self, req: Request, event: str) -> None:
        """Hears 'admitted', 'preempted', 'swapped' and 'finished'."""


PolicyError = PolicyLoadError  # the name this module exported first


PLUGINS = PluginKind(ENTRY_POINT_GROUP, "policy", "policies", "pip install -e ./policies", PolicyError)


def installed_policies() -> dict[str, importlib.metadata.EntryPoint]:
    return PLUGINS.installed()


REQUIRED_METHODS = ("waiting_queue", "select_victim", "preemption_mode", "should_preempt_for", "on_event")


def resolve_policy(spec: str | Policy | type, options: dict | None = None) -> tuple[type, str]:
    """The policy's class and label, found and checked without constructing it: what a front end runs
    before any weights load, so a wrong `--policy` fails in a second, not after the model is up."""
    if isinstance(spec, Policy):
        return type(spec), spec.name
    if isinstance(spec, type):
        cls, label = spec, spec.__name__
    else:
        label = spec
        cls = PLUGINS.load(spec)
    if not callable(cls):
        raise PolicyError(f"policy {label!r} is not a class: {cls!r}")
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise PolicyError(f"policy {label!r} does not implement {', '.join(missing)}")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to check against (a builtin): construction will tell
        signature = None
    if signature is not None:
        try:
            signature.bind(**(options or {}))
        except TypeError as exc:
            raise PolicyError(f"policy {label!r} failed to construct: TypeError: {exc}") from None
    return cls, label


def load_policy(spec: str | Policy | type, options: dict | None = None) -> Policy:
    """A policy from an installed name, 'module:Class', 'path/to/file.py:Class', a class or an instance."""
    if isinstance(spec, Policy):
        return spec
    cls, label = resolve_policy(spec, options)
    try:
        policy = cls(**(options or {}))
    except Exception as exc:
        raise PolicyError(f"policy {label!r} failed to construct: {type(exc).__name__}: {exc}") from exc
    queue = policy.waiting_queue()
    missing = [m for m in ("add", "pop", "peek", "prepend", "remove", "__len__", "__iter__") if not hasattr(queue, m)]
    if missing:
        raise PolicyError(f"policy {label!r}: its waiting queue lacks {', '.join(missing)}")
    if not getattr(policy, "name", None) or policy.name == "base":
        policy.name = label if isinstance(label, str) else type(policy).__name__
    return policy


def describe_installed() -> list[tuple[str, str]]:
    """(name, one-line description) of every installed policy; a broken one says why instead."""
    rows = []
    for name, ep in sorted(installed_policies().items()):
        try:
            cls = ep.load()
            doc = getattr(cls, "description", "") or (cls.__doc__ or "").strip().splitlines()[0]
        except Exception as exc:  # noqa: BLE001 - listing must survive a broken plugin
            doc = f"(broken: {type(exc).__name__}: {exc})"
        rows.append((name, doc))
    return rows
