"""Every error aserve raises on purpose, in one place, and how an error crosses from the core's process.

The classes say what went wrong; the server maps them to statuses by type (server/errors.py), and the
CLI prints the configuration errors as one line. An error raised in the engine-core child travels as its
class name, args and `param` (`RemoteError`), and the parent raises the same type again; a type outside
this module and a few builtins becomes `RemoteEngineError`, which names the original type.
"""
from __future__ import annotations

import msgspec


class AserveError(Exception):
    """Base of aserve's own errors."""


# -- bad input and bad configuration: the caller can fix these --------------------------------------

class InvalidRequestError(AserveError, ValueError):
    """A request the engine could never serve. `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(AserveError, ValueError):
    """An engine option that cannot work; found before any weights load where possible."""


class PolicyLoadError(ConfigError):
    """The scheduling policy cannot be found, imported or constructed."""


class ModelLoadError(ConfigError):
    """The model folder cannot be served (an unsupported architecture, a broken config.json)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model folder or its config.json does not exist."""


# -- the engine's state: the caller may retry, or must give up --------------------------------------

class EngineError(AserveError, RuntimeError):
    """The engine could not serve a request for reasons of its own."""


class EngineDeadError(EngineError):
    """The engine core stopped; no request can be served until the process restarts."""


class ReplicaDeadError(EngineDeadError):
    """The data-parallel replica holding this request died; the other replicas serve on, so a retry may succeed."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full: the request was refused, and may be retried later."""


class RequestFailedError(EngineError):
    """The engine ended this request with an error (NaN logits, a detokenizer failure); the others go on."""


class RemoteEngineError(EngineError):
    """The engine core raised an error of a type the front end does not rebuild; the message names it."""


class RequestTimeoutError(AserveError, TimeoutError):
    """The request ran past its timeout and was aborted."""


# -- across the process boundary ------------------------------------------------------------------

SAFE_BUILTINS = (ValueError, TypeError, KeyError, IndexError, FileNotFoundError, NotImplementedError,
                 TimeoutError, MemoryError)
REBUILDABLE: dict[str, type[BaseException]] = {
    cls.__name__: cls for cls in (*SAFE_BUILTINS, *(obj for obj in list(globals().values())
                                                    if isinstance(obj, type) and issubclass(obj, AserveError)))}
Plain = str | int | float | bool | None


class RemoteError(msgspec.Struct, frozen=True):
    """An exception as data: its class name, its args (plain values only) and its `param`, if any."""
    type_name: str
    args: tuple[Plain, ...]
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> "RemoteError":
        args = exc.args if all(isinstance(a, Plain) for a in exc.args) else (str(exc),)
        return cls(type(exc).__name__, args, getattr(exc, "param", None))

    def describe(self) -> str:
        return f"{self.type_name}: {', '.join(str(a) for a in self.args)}"

    def rebuild(self) -> Exception:
        """The same type again where it is one of ours or a safe builtin; else a RemoteEngineError naming it."""
        cls = REBUILDABLE.get(self.type_name)
        if cls is None:
            return RemoteEngineError(f"the engine core raised {self.describe()}")
        exc = cls(*self.args)
        if self.param is not None:
            exc.param = self.param
        return exc
