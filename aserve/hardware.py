"""What the machine can do fast, asked of torch and oneDNN, and the dtype `auto` picks from it.

On a CPU without native bf16 (no AVX512-BF16, no AMX) torch emulates bfloat16 matmuls: measured on an
AVX2-only EPYC, a 2048x576x1536 matmul ran at 0.9 GFLOP/s in bf16 against 68 GFLOP/s in fp32. A bf16
checkpoint must therefore run in float32 there, and the engine says so at start-up. The CPU model changes
between machines of one deployment, so nothing here is a hard-coded list of CPUs.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("aserve")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_warned: set[str] = set()


@dataclass(frozen=True)
class CpuInfo:
    capability: str  # torch's kernel dispatch level: DEFAULT, AVX2, AVX512, ...
    native_bf16: bool  # AVX512-BF16 or AMX tiles: bf16 GEMMs run in hardware
    native_fp16: bool  # AVX512-FP16 or AMX-FP16, as oneDNN reports it
    threads: int
    amx_bf16: bool = False  # AMX tiles: the bf16 GEMMs (aserve's and oneDNN's) multiply on them

    def describe(self) -> str:
        """One line for logs and benchmark headers: what a figure was measured on."""
        flags = ", ".join(f"{name} {'native' if ok else 'emulated'}"
                          for name, ok in (("bf16", self.native_bf16), ("fp16", self.native_fp16)))
        amx = ", AMX" if self.amx_bf16 else ""
        return f"CPU capability {self.capability} ({flags}{amx}), {self.threads} threads"


def _probe(name: str) -> bool:
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else False
    except Exception:  # noqa: BLE001 - a probe that fails means "not there"
        return False


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    mkldnn = torch.backends.mkldnn.is_available()
    bf16 = mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported() and (
        _probe("_is_avx512_bf16_supported") or _probe("_is_amx_tile_supported"))
    fp16 = mkldnn and torch.ops.mkldnn._is_mkldnn_fp16_supported()
    amx = bool(bf16) and _probe("_is_amx_tile_supported")
    return CpuInfo(torch.backends.cpu.get_cpu_capability(), bool(bf16), bool(fp16), torch.get_num_threads(), amx)


def native(dtype: torch.dtype, device: torch.device, info: CpuInfo | None = None) -> bool:
    """Whether `dtype` matmuls run in hardware on `device` (float32 always does)."""
    if dtype == torch.float32:
        return True
    if device.type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported()
    info = info or cpu_info()
    return info.native_bf16 if dtype == torch.bfloat16 else info.native_fp16


def checkpoint_dtype(config: dict) -> torch.dtype:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    return DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def resolve_dtype(option: str, config: dict, device: torch.device = torch.device("cpu"),
                  info: CpuInfo | None = None) -> tuple[torch.dtype, str]:
    """The dtype to run in and why (for the start-up log line).

    `auto` keeps the checkpoint's dtype where the hardware runs it natively; a 16-bit checkpoint on a CPU
    without it falls back to bf16 (for fp16, where bf16 is native) or else float32. An explicit 16-bit dtype
    is honoured, with one warning per process when it is emulated.
    """
    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    where = "this GPU" if device.type == "cuda" else f"this CPU ({(info or cpu_info()).capability})"
    if option != "auto":
        dtype = DTYPES[option]
        if not native(dtype, device, info) and option not in _warned:
            _warned.add(option)
            log.warning("dtype %s is emulated on %s, which lacks native %s (AVX512-BF16/AMX or AVX512-FP16): "
                        "expect it to run many times slower than float32; --dtype auto picks float32 here",
                        option, where, option)
        return dtype, f"{option}, as asked"
    wanted = checkpoint_dtype(config)
    if native(wanted, device, info):
        return wanted, f"auto: the checkpoint's {name(wanted)}, native on {where}"
    if wanted == torch.float16 and native(torch.bfloat16, device, info):
        return torch.bfloat16, f"auto: the checkpoint is float16, emulated on {where}; bfloat16 is native"
    return torch.float32, (f"auto: the checkpoint is {name(wanted)}, but {where} has no native {name(wanted)} "
                           f"(AVX512-BF16/AMX or AVX512-FP16) and emulating it is far slower than float32")


def resolve_device(option: str = "auto") -> torch.device:
    """The device the `device` option names: `auto` is the current CUDA GPU when torch sees one, else the CPU."""
    if option == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(option)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {option!r} was asked for, but torch sees no CUDA GPU here: use device='cpu'")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return device
