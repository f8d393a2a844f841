"""LoRASlots: `max_loras` device slots of stacked adapter weights, and an LRU host cache of loaded adapters.

The slots are the stacked weights of each adapted layer (lora.layers.LoRALinear), zero-padded to the largest rank: an
unused rank, module or layer contributes exactly 0. A step's adapters
get slots (`acquire`), loaded from the host cache or, once, from disk; only slots this step does not use are
evicted, least recently used first; `release` unpins them after the step.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from aserve.lora import adapter
from aserve.lora.request import ResolvedLoRA


class LoRASlots:
    def __init__(self, layers: dict[tuple[int, str], "LoRALinear"], targets: dict[str, tuple[int, int]],
                 num_layers: int, max_loras: int, max_rank: int, max_cpu_loras: int, dtype: torch.dtype):
        self.layers, self.targets, self.num_layers = layers, targets, num_layers
        self.max_rank, self.dtype = max_rank, dtype
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # identity -> slot, least recently used first
        self.host: OrderedDict[str, adapter.LoadedAdapter] = OrderedDict()  # identity -> weights, LRU
        self.in_use: set[int] = set()  # the slots of the running step
        self.disk_loads = 0

    def acquire(self, loras: list[ResolvedLoRA]) -> dict[str, int]:
        """Slots for this step's distinct adapters (at most max_loras: the scheduler's rule), pinned until release."""
        by_identity = {lora.identity: lora for lora in loras}
        if len(by_identity) > self.max_loras:
            raise RuntimeError(f"a step with {len(by_identity)} adapters; max_loras is {self.max_loras}")
        for identity in by_identity:
            if identity in self.slot_of:
                self.slot_of.move_to_end(identity)
                self.in_use.add(self.slot_of[identity])
        for identity, lora in by_identity.items():
            if identity not in self.slot_of:
                slot = self._free_slot()
                self._write(slot, self._host_copy(lora))
                self.slot_of[identity] = slot
                self.in_use.add(slot)
        return {identity: self.slot_of[identity] for identity in by_identity}

    def release(self) -> None:
        self.in_use.clear()

    def _free_slot(self) -> int:
        taken = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        victim = next(i for i, slot in self.slot_of.items() if slot not in self.in_use)
        return self.slot_of.pop(victim)

    def _host_copy(self, lora: ResolvedLoRA) -> adapter.LoadedAdapter:
        loaded = self.host.get(lora.identity)
        if loaded is None:
            loaded = adapter.load(lora, self.targets, self.num_layers, self.max_rank, self.dtype)
            self.disk_loads += 1
            self.host[lora.identity] = loaded
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(lora.identity)
        return loaded

    def _write(self, slot: int, loaded: adapter.LoadedAdapter) -> None:
        """Every (layer, module) of the slot: the adapter's weights, or zeros where it leaves the module alone."""
        for (layer, module), lora_linear in self.layers.items():
            a_t, b_t = loaded.weights.get((layer, module), (None, None))
            lora_linear.write(slot, module, a_t, b_t)
        for lora_linear in dict.fromkeys(self.layers.values()):  # each layer once, though it adapts several modules
            lora_linear.repack()
