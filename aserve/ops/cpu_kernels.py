"""aserve's CPU kernels (csrc/*.cpp) as torch ops: built once per CPU kind, cached on disk.

Fused decode and prefill attention over the paged cache, KV cache writes, RMSNorm, rotary embedding, SiLU-and-mul,
the int8 linear and sampling, each one pass instead of a chain of small torch ops (a csrc/*.cpp file per family:
attention_decode, attention_prefill, kv_write, norm_activation, int8_linear, sampling, lora; their shared helpers in
csrc/vec_helpers.h), aserve's GEMMs for packed fp32 weights and, on CPUs with AVX512-BF16, bf16 ones, and for int8
weights in int8_linear's tiles (csrc/cpu_gemm.cpp, see ops.cpu_gemm), and the bandwidth probe of `aserve bench
roofline` (csrc/memory_stream.cpp). All are one extension, compiled with -march=native, so the build is cached
per CPU feature set, torch version and source (a library built on an AVX-512 machine would crash on an AVX2 one).
The first use on a machine compiles it (2-3 minutes on 2 cores, spread over them by ninja); later start-ups
load the cached library directly (a `built` mark beside it says it loaded once). Where no compiler is found, or
with ASERVE_CPU_KERNELS=0, `available()` is False and every caller keeps its torch path.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger("aserve")

SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.cpp"))  # every file compiled into the one extension
HEADERS = sorted(Path(__file__).with_name("csrc").glob("*.h"))  # included by them: part of the cache key too


def cflags() -> list[str]:
    """-march=native, the CPU_CAPABILITY macros that make at::vec::Vectorized use AVX-512 or AVX2 lanes, and
    OpenMP, without which at::parallel_for (inlined from the headers) runs on one thread. The libgomp it links
    is the one torch already loaded (same soname), so both share one thread pool. ASERVE_KERNEL_ARCH names another
    -march (`haswell` with ATEN_CPU_CAPABILITY=avx2: the AVX2-only build, on an AVX-512 machine, for its tests)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", f"-march={os.environ.get('ASERVE_KERNEL_ARCH') or 'native'}", "-fno-math-errno", "-fopenmp"]
    if capability in ("AVX512", "AVX2"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return flags


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def build_dir() -> Path:
    """One folder per (sources and headers, their paths, flags, torch, CPU features): a changed CPU gets its own
    build, and two checkouts do not take turns rebuilding one folder (ninja's build file names the sources' paths)."""
    parts = [text for source in (*SOURCES, *HEADERS) for text in (source.read_text(), str(source))]
    key = hashlib.sha256("\n".join([*parts, " ".join(cflags()), torch.__version__,
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    root = os.environ.get("ASERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "aserve")
    return Path(root) / "cpu_kernels" / key


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja wheel installs it beside the interpreter, which is not on PATH
    when the venv's `aserve` is run without activating the venv."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def available() -> bool:
    """Load (building first if needed) the kernels; False, with one warning, where they cannot be had."""
    if os.environ.get("ASERVE_CPU_KERNELS", "1").lower() in ("0", "false", "off"):
        return False
    try:
        folder = build_dir()
        library, built = folder / "aserve_cpu_kernels.so", folder / "built"
        if built.exists() and library.exists():  # this build loaded before: skip cpp_extension's import and ninja
            torch.ops.load_library(str(library))
            return True
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        load(name="aserve_cpu_kernels", sources=[str(source) for source in SOURCES], extra_cflags=cflags(),
             extra_ldflags=["-fopenmp"],
             build_directory=str(folder), is_python_module=False, verbose=False)
        took = time.perf_counter() - start
        if took > 1.0:
            log.info("built aserve's CPU kernels in %.1fs (cached in %s)", took, folder)
        built.touch()
        return True
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        reason = next((line for line in lines if "error" in line.lower() and "building extension" not in line),
                      lines[0])
        log.warning("aserve's CPU kernels are unavailable (%s); using the torch path", reason.strip()[:300])
        return False


KERNEL_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


def usable(*tensors: torch.Tensor) -> bool:
    """True where the kernels serve these tensors now: all on the CPU, in a dtype the kernels take, and no
    gradient being recorded (the ops have no autograd: inference only). Asked before every kernel call, so
    written as a plain loop (a third of the time of `all()` over a generator)."""
    if torch.is_grad_enabled() or not available():
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype not in KERNEL_DTYPES:
            return False
    return True
