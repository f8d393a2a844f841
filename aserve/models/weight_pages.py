"""A loaded CPU model's weights in 2 MiB pages: one mapping advised for transparent huge pages, every tensor the
model holds copied into it in the order a step reads them (`weights_in_huge_pages`, called by the loader)."""
from __future__ import annotations

import logging
import mmap
import os
import re
import sys

import torch

log = logging.getLogger("aserve")

HUGE_PAGE = 2 << 20
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never); None where there is none to read."""
    try:
        with open(THP_MODE_FILE) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return found.group(1) if found else None


def module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every CPU tensor the modules hold, once each, in module order: parameters, buffers, and tensors in plain
    attributes, also inside tuples, lists and dicts (a packed weight's PackedWeight, a projection's tiles)."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.layout == torch.strided and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            visit(value)
    return found


def weights_in_huge_pages(model: torch.nn.Module) -> int:
    """Copy the model's CPU tensors, in module order (the order a step reads them), into one private anonymous
    mapping advised for 2 MiB pages, and point each tensor at its copy (Tensor.set_, so every holder of the tensor
    sees the move; views of one storage stay views of one copy). Returns the bytes moved: 0 off Linux, where the
    kernel's transparent huge pages are off, or with ASERVE_HUGE_PAGE_WEIGHTS=0.

    Why: a decode step streams every weight from DRAM, and with 4 KiB pages the reads cross a page, and miss the
    TLB, every 4 KiB. The bench model's 120 linear layers at one row, weights cold, alternated in one process (AMD
    EPYC; avx2 avx512_bf16 avx512f, 2 threads): bf16 5.10 -> 4.73 ms, GPTQ int4 1.69 -> 1.53 ms. The same copy into
    4 KiB pages was no faster (5.25 and 1.78 ms): the pages are what counts, not the weights' order. Costs a copy
    at load (the bench model's 513 MiB: 0.9 s) and nothing after."""
    if (os.environ.get("ASERVE_HUGE_PAGE_WEIGHTS", "1") == "0" or not sys.platform.startswith("linux")
            or not hasattr(mmap, "MADV_HUGEPAGE") or transparent_huge_pages() in (None, "never")):
        return 0
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in module_tensors(model):
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            storages.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    total = sum(-(-storage.nbytes() // 64) * 64 for storage, _ in storages.values())
    if total == 0:
        return 0
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping for as long as a tensor points into it
    offset = -arena.data_ptr() % HUGE_PAGE  # the first 2 MiB boundary: pages from there can be huge
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, total)
    except OSError as exc:  # a kernel built without huge pages: nothing to gain from the copy
        log.debug("madvise(MADV_HUGEPAGE) refused (%s); weights stay where they are", exc)
        return 0
    target = arena.untyped_storage()
    pending = list(storages.values())[::-1]  # popped in module order, each old storage let go once moved
    del storages
    with torch.inference_mode():  # set_ on a tensor made under inference mode is refused outside it
        while pending:
            storage, tensors = pending.pop()
            nbytes = storage.nbytes()
            arena[offset:offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,)))
            for tensor in tensors:  # offset is a multiple of 64: of every element size
                tensor.set_(target, offset // tensor.element_size() + tensor.storage_offset(), tensor.size(),
                            tensor.stride())
            offset += -(-nbytes // 64) * 64
            del storage, tensors  # the old memory goes now, not after the whole model: the peak is one tensor more
    return total
