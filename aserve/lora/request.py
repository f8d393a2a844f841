"""LoRARequest: which adapter a request runs under (vLLM's fields and meaning), and the engine's resolved form.

Plain data, no torch: it crosses from the caller to the core, and from the scheduler to the worker."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: a label for logs; `lora_int_id`: a positive id the caller chooses; `lora_path`: a PEFT adapter
    folder (adapter_config.json + adapter_model.safetensors or .bin). `base_model_name` is informational: the
    base is checked by the adapter's tensor shapes."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")


@dataclass(frozen=True)
class ResolvedLoRA:
    """An adapter checked at admission: where it lives and its content identity (a digest of its files), which
    keys the worker's slots and the prefix cache, so an adapter rewritten under the same name is a new one."""
    name: str
    path: str
    identity: str

    @property
    def hash_root(self) -> bytes:
        """The root of its requests' chained block hashes: no KV block is shared with another adapter."""
        return b"lora:" + self.identity.encode()


@dataclass(frozen=True)
class LoRAFacts:
    """What an adapter is checked against, known once the model is loaded: the modules it may target with their
    (in, out) features, the number of layers, and the largest rank served."""
    targets: dict[str, tuple[int, int]]
    num_layers: int
    max_rank: int
