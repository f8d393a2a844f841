"""The server's named adapters: `--lora-modules` at start, /v1/load_lora_adapter and /v1/unload_lora_adapter at
run time. A request names its adapter in `model`; the registry turns that name into the LoRARequest the engine runs.

Plain data, no torch. Unloading removes the name only: requests already running under it finish with the adapter
they were admitted with (the engine holds its own reference).
"""
from __future__ import annotations

import json

from aserve.lora.request import LoRARequest


def parse_module(spec: str) -> LoRARequest:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form `{"name": ..., "path": ...,
    "base_model_name": ...}`. The id is set when the registry takes it."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            raw = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {spec!r}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            raise ValueError(f"--lora-modules {spec!r}: the JSON form needs string fields name and path")
        unknown = set(raw) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules {spec!r}: unknown field(s) {', '.join(sorted(unknown))}")
        name, path, base = raw["name"], raw["path"], raw.get("base_model_name")
    else:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected name=path or a JSON object")
        base = None
    return LoRARequest(name, 1, path, base)


class LoRARegistry:
    """Adapter name -> LoRARequest, each with its own lora_int_id (never reused, as vLLM's server does)."""

    def __init__(self, reserved: frozenset[str] = frozenset()):
        self.reserved = reserved  # the base model's names: no adapter may take one
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if not name:
            raise ValueError("an adapter needs a name")
        if name in self.reserved:
            raise ValueError(f"the adapter name {name!r} is the base model's")
        if name in self.adapters:
            raise ValueError(f"the adapter {name!r} is already loaded; unload it first")
        lora = LoRARequest(name, self._next_id, path, base_model_name)
        self._next_id += 1
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)
