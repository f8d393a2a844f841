"""Quantized weights: which format a model's linear layers take, decided once from the engine options and the
checkpoint's config.json, and checked before any weight is read.

- `int8`: weight-only, one symmetric scale per output channel, quantized at load from a 16/32-bit checkpoint.
- `gptq`, `awq`: 4-bit checkpoints quantized elsewhere (AutoGPTQ / GPTQModel, AutoAWQ), recognised by the
  `quantization_config` of config.json and repacked at load for aserve's int4 kernels (torch's without them).
  Their quantizers leave the logits projection dense; `quantize_lm_head` makes it int8 at load, as `int8` does.
  A GPTQ checkpoint quantized with its head too (an `lm_head.qweight`) keeps it int4 (quantization.loading).

This module reads only dictionaries (no torch), so a front end can refuse a wrong flag at once; the formats
themselves live in base (the seam), int8, gptq, awq and int4 (what GPTQ and AWQ become), and loading applies
them to a built model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

METHODS = ("int8", "gptq", "awq")  # --quantization's choices
PREQUANTIZED = ("gptq", "awq")


@dataclass(frozen=True)
class QuantSpec:
    """A model's weight format, validated."""
    method: str  # one of METHODS
    bits: int = 8
    group_size: int = -1  # inputs sharing one scale and zero; -1: all of a row's inputs
    desc_act: bool = False  # GPTQ's act-order: g_idx assigns inputs to groups out of order
    zero_plus_one: bool = False  # GPTQ's v1 checkpoints store each zero point minus one
    quantize_lm_head: bool = False  # the logits projection too: int8, or GPTQ/AWQ's dense head as int8

    def describe(self) -> str:
        if self.method == "int8":
            return "int8 weight-only (per-output-channel scales" + (", LM head too)" if self.quantize_lm_head else ")")
        group = "per row" if self.group_size == -1 else f"group size {self.group_size}"
        act = ", desc_act" if self.desc_act else ""
        head = ", a dense LM head as int8" if self.quantize_lm_head else ""
        return f"{self.method} int{self.bits} ({group}{act}{head})"


def resolve(config: dict, quantization: str | None = None, quantize_lm_head: bool = False) -> QuantSpec | None:
    """The weight format of a model from its config.json and the `quantization` option; None for dense weights.
    A ValueError names what is unsupported or contradictory."""
    if quantization is not None and quantization not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (or unset), got {quantization!r}")
    found = config.get("quantization_config")
    if found:
        method = str(found.get("quant_method", "")).lower()
        if method not in PREQUANTIZED:
            raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported; aserve "
                             f"loads {' and '.join(PREQUANTIZED)} 4-bit checkpoints, and quantizes 16/32-bit ones with "
                             "--quantization int8")
        if quantization not in (None, method):
            raise ValueError(f"--quantization {quantization}: the checkpoint is already quantized with {method} "
                             f"(config.json quantization_config); drop the flag or pass --quantization {method}")
        spec = _gptq(found) if method == "gptq" else _awq(found)
        return replace(spec, quantize_lm_head=quantize_lm_head)
    if quantization in PREQUANTIZED:
        raise ValueError(f"--quantization {quantization} loads checkpoints quantized with {quantization}, and this "
                         "config.json has no quantization_config; use --quantization int8 to quantize at load, or "
                         f"write a {quantization} copy first (round-to-nearest: python -m aserve.bench.quantize_rtn "
                         f"SRC DST --method {quantization})")
    if quantization == "int8":
        return QuantSpec("int8", quantize_lm_head=quantize_lm_head)
    if quantize_lm_head:
        raise ValueError("--quantize-lm-head needs --quantization int8 or a GPTQ/AWQ checkpoint")
    return None


def _bits(found: dict, method: str) -> int:
    bits = found.get("bits", found.get("w_bit"))
    if bits != 4:
        raise ValueError(f"config.json: {method} with {bits} bits is not supported; aserve loads 4-bit "
                         f"{method} checkpoints")
    return bits


def _group_size(found: dict, method: str) -> int:
    group = found.get("group_size", found.get("q_group_size", -1))
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise ValueError(f"config.json: {method} group_size must be -1 or a positive integer, got {group!r}")
    return group


def _gptq(found: dict) -> QuantSpec:
    fmt = str(found.get("checkpoint_format") or "gptq").lower()
    if found.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"config.json: GPTQ checkpoint_format {'marlin' if found.get('is_marlin_format') else fmt!r} "
                         "is not supported (gptq, gptq_v2)")
    return QuantSpec("gptq", bits=_bits(found, "gptq"), group_size=_group_size(found, "gptq"),
                     desc_act=bool(found.get("desc_act", False)), zero_plus_one=fmt == "gptq")


def _awq(found: dict) -> QuantSpec:
    version = str(found.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"config.json: AWQ version {version!r} is not supported; aserve loads the GEMM layout "
                         "(version gemm)")
    if not found.get("zero_point", True):
        raise ValueError("config.json: AWQ without zero points (zero_point false) is not supported")
    return QuantSpec("awq", bits=_bits(found, "awq"), group_size=_group_size(found, "awq"))
