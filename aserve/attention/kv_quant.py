"""The FP8 KV cache: keys and values stored as one byte each, with a per-layer scale for K and one for V.

vLLM's names and conventions: `fp8` (= `fp8_e4m3`) or `fp8_e5m2`; the cache holds the FP8 bit patterns as
uint8 (so every copy, swap and zeroing of blocks stays a byte copy), a value x is stored as fp8(x / scale),
saturated to the format's largest finite value, and read back as fp8 * scale. Scales come from the
checkpoint (read by models.loader.checkpoint_kv_scales), else are estimated from the first batch each layer
sees when asked (`calculate_kv_scales`), else are 1.0, as vLLM does.

Attention reads the cache through the backend, which dequantizes inside its kernel or, on the torch path,
right after gathering a context. The kernels (C++ decode, Triton) widen a byte through fp16 bit patterns:
e5m2 is an fp16's top byte; e4m3's exponent and mantissa moved into fp16's place read as the value times
2^-8 (bias 7 against 15), normals and subnormals alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from aserve.config import KV_CACHE_DTYPES
from aserve.ops import cpu_kernels
from aserve.ops.attention import write_kv

# Headroom of an estimated scale: the first batch's largest |x| lands at half the format's range, so later
# batches up to twice as large still fit (vLLM divides by a fixed 200 for e4m3's 448 for the same reason).
ESTIMATE_HEADROOM = 2.0


@dataclass(frozen=True)
class FP8Format:
    name: str  # vLLM's name, as the start-up line, metrics and /info show it
    dtype: torch.dtype  # torch's type with this bit layout, for conversions on the torch path
    code: int  # what the C++ and Triton kernels take: 1 = e4m3, 2 = e5m2 (0 = the cache is not quantized)

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)


FP8_FORMATS = {"fp8_e4m3": FP8Format("fp8_e4m3", torch.float8_e4m3fn, 1),
               "fp8_e5m2": FP8Format("fp8_e5m2", torch.float8_e5m2, 2)}


def resolve(kv_cache_dtype: str) -> FP8Format | None:
    """The FP8 format of a --kv-cache-dtype value, or None for `auto` (the cache in the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return None
    return FP8_FORMATS["fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype]


def quantize(x: torch.Tensor, scale: float, fmt: FP8Format) -> torch.Tensor:
    """x -> the uint8 bit patterns of fp8(x / scale), saturated (fp8 e4m3 has no infinity to overflow to)."""
    y = x.float() * (1.0 / scale)
    return y.clamp_(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)


def dequantize(bits: torch.Tensor, scale: float, fmt: FP8Format, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bit patterns -> fp8 values * scale, in `dtype`."""
    return (bits.view(fmt.dtype).float() * scale).to(dtype)


def set_scales(layers: list, scales: dict[int, tuple[float, float]], estimate: bool) -> None:
    """Give every attention layer its (k_scale, v_scale): the checkpoint's where it has them; else 1.0, or
    an estimate from the layer's first batch when `estimate`."""
    for i, layer in enumerate(layers):
        layer.k_scale, layer.v_scale = scales.get(i, (1.0, 1.0))
        layer.kv_scales_pending = estimate and i not in scales


def estimate_scales(layer, key: torch.Tensor, value: torch.Tensor, fmt: FP8Format) -> None:
    """Set a layer's scales from the first keys and values it writes (once per layer)."""
    def scale(x: torch.Tensor) -> float:
        peak = float(x.abs().amax()) if x.numel() else 0.0
        return peak * ESTIMATE_HEADROOM / fmt.max if peak > 0 else 1.0

    layer.k_scale, layer.v_scale = scale(key), scale(value)
    layer.kv_scales_pending = False


def write(layer, kv_cache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
          fmt: FP8Format | None, paired_keys: bool) -> None:
    """Store a step's keys and values in a layer's cache: as they are, or as FP8 bytes (the layer's scales
    estimated first, on its first batch, where that was asked); keys as rows or, with `paired_keys`, in the
    torch backend's layout (ops.attention). One C++ op on the CPU, torch ops elsewhere."""
    k_cache, v_cache = kv_cache
    if fmt is not None and layer.kv_scales_pending:
        estimate_scales(layer, key, value, fmt)
    if cpu_kernels.usable(key, value) and (fmt is not None or k_cache.dtype == key.dtype):
        torch.ops.aserve.write_kv(key, value, k_cache, v_cache, slot_mapping, layer.k_scale, layer.v_scale,
                                  0 if fmt is None else fmt.code, paired_keys)
        return
    if fmt is not None:
        key, value = quantize(key, layer.k_scale, fmt), quantize(value, layer.v_scale, fmt)
    write_kv(k_cache, v_cache, key, value, slot_mapping, paired_keys)


def as_stored(x: torch.Tensor, scale: float, fmt: FP8Format) -> torch.Tensor:
    """x as the cache gives it back (quantized and dequantized), for attention that reads fresh keys: outputs
    must not depend on whether a context came from the step or from the cache."""
    return dequantize(quantize(x, scale, fmt), scale, fmt, x.dtype)
