"""Host memory: lazily zeroed cache tensors, large per-step allocations kept in glibc's heap, and the
memory figures a soak test watches (resident set, heap, Python objects).

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
