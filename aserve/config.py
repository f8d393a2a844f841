"""Engine options in one place, with the parsing that the CLI, LLM and AsyncLLM share."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
DEFAULT_MODEL_NAME = "aserve-default"
log = logging.getLogger("aserve")

# vLLM engine arguments a ported script may pass that mean nothing here (with their harmless values).
VLLM_ONLY_OPTIONS = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "gpu_memory_utilization": None,
                     "enforce_eager": None, "trust_remote_code": None,
                     "distributed_executor_backend": None, "disable_custom_all_reduce": None}


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int or a string such as '4GiB', '512MiB', '2GB', '1.5G' or '1000000'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"kv_cache_memory must be bytes or a size like '4GiB', got {value!r}")
    number, unit, suffix = float(m.group(1)), m.group(2).upper(), (m.group(3) or "").lower()
    base = 1000 if suffix == "b" and unit else 1024
    return int(number * base ** " KMGT".index(unit or " "))


@dataclass
class EngineConfig:
    model: str | None = None  # a local Hugging Face folder; None = the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    block_size: int = 16
    kv_cache_memory: int | str = "4GiB"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    policy: str | object = "fcfs"
    policy_options: dict | None = None  # keyword arguments for the policy's constructor
    swap_space: float | str = 4  # GiB of host memory for swapped-out KV blocks (a number) or a size string
    seed: int = 0
    served_model_name: str | None = None
    disable_log_stats: bool | None = None  # the periodic stats line; None = off offline, on when serving
    max_n: int = 32  # the most samples one prompt may ask for (n): each costs as much as a request
    max_waiting_requests: int | None = None  # new requests beyond this many waiting are refused (overload)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = str(DEFAULT_MODEL_DIR)
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        self.swap_space = (int(self.swap_space * 1024 ** 3) if isinstance(self.swap_space, (int, float))
                           else parse_memory(self.swap_space))
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {self.max_waiting_requests}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be one of auto, bfloat16, float16, float32, got {self.dtype!r}")

    @property
    def model_name(self) -> str:
        """The name clients and metrics use: --served-model-name, else the model folder as given."""
        if self.served_model_name:
            return self.served_model_name
        return DEFAULT_MODEL_NAME if self.model == str(DEFAULT_MODEL_DIR) else self.model

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        for name in set(kwargs) & set(VLLM_ONLY_OPTIONS):
            value = kwargs.pop(name)
            if value != VLLM_ONLY_OPTIONS[name]:
                log.warning("ignoring vLLM option %s=%r: it has no meaning in aserve", name, value)
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)
