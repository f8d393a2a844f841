"""Host memory: lazily zeroed cache tensors, large per-step allocations kept in glibc's heap, the model's weights
in 2 MiB pages, and the memory figures a soak test watches (resident set, heap, Python objects).

Each decode step allocates and frees tensors of several MB (gathered K/V, logits). By default glibc serves
those with mmap and returns them with munmap, so every step pays page faults on memory it just had; on
the 2-core benchmark this costs ~15% of output throughput. Raising the mmap and trim thresholds keeps
that memory mapped and reused (the effect vLLM's CPU backend gets by preloading tcmalloc).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import math
import mmap
import os
import re
import sys
import threading
import time
from typing import NamedTuple

import torch

log = logging.getLogger("aserve")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once: find_library runs ldconfig (and may run gcc), tens of ms a call."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def keep_large_allocations_in_heap(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 31) -> bool:
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    except AttributeError:  # not glibc
        return False
    if not ok:
        log.debug("mallopt refused the thresholds; large allocations stay mmapped")
    return ok


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor backed by an anonymous mapping: pages are zeroed by the kernel on first
    touch, so a 4 GiB KV budget costs neither time nor resident memory until blocks are used.
    (torch.zeros writes every byte up front.) Plain 4 KiB pages: a private mapping advised for 2 MiB pages
    did get them, but the bench model's 64 x 128/128 run went slower (19.0 and 19.6 s against 23.5 and
    20.1 s, the prefill steps most: each first touch zeroes and compacts 2 MiB), and decode attention over
    the cache sped up by only 4% (0.665 -> 0.640 ms a layer; it is bound by DRAM, not the TLB)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


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
    with torch.no_grad():
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


def rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc; None elsewhere): what a soak test watches for leaks."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_bytes() -> dict[str, int] | None:
    """glibc's heap: bytes in use by live allocations vs bytes it keeps free for reuse (None off glibc).
    With the thresholds above the heap does not shrink, so RSS rises to the largest step's working set and
    stays; in-use bytes that keep climbing under a steady load would be a real leak."""
    fn = getattr(_libc(), "mallinfo2", None)  # glibc 2.33 and later
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks}


DIAGNOSTICS_MAX_AGE_S = 2.0  # how stale memory_diagnostics() may be: a caller polling faster gets the cached figures


class MemoryDiagnostics(NamedTuple):
    heap_bytes: dict[str, int] | None  # heap_bytes()
    python_objects: int  # objects the garbage collector tracks: a count that climbs under steady load is a leak
    age_s: float  # how long ago they were measured


_diagnostics: tuple[float, dict[str, int] | None, int] | None = None
_diagnostics_lock = threading.Lock()


def memory_diagnostics(max_age_s: float = DIAGNOSTICS_MAX_AGE_S) -> MemoryDiagnostics:
    """This process's heap and Python object counts, measured at most once per `max_age_s`: counting the objects
    walks every one of them (tens of ms with torch loaded), too slow to do between steps on every request."""
    global _diagnostics
    with _diagnostics_lock:
        now = time.monotonic()
        if _diagnostics is None or now - _diagnostics[0] > max_age_s:
            _diagnostics = (now, heap_bytes(), len(gc.get_objects()))
        measured, heap, objects = _diagnostics
    return MemoryDiagnostics(heap, objects, now - measured)
