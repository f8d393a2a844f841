"""The linear-method seam: how a linear layer holds its weights and multiplies by them.

A model builds `aserve.models.layers.Linear` modules and never asks what is inside. Each one has a
`LinearMethod`, chosen once per model from the config (aserve.quantization.resolve): the method registers the
layer's parameters in the checkpoint's own layout (`create_weights`), turns them into the form it computes with
once they are filled (`process_after_loading`: quantize, repack) and multiplies (`apply`). A new weight format is a
new method, not an `if` in the model code.

Fused projections (q|k|v, gate|up) are one layer whose shards are concatenated along the output dimension. Each
parameter says how a shard lands in it: `output_dim` (the dimension that holds outputs, None when every shard
carries the whole tensor, as GPTQ's g_idx) and `pack_factor` (outputs per stored element along it, 8 for int4
packed eight to an int32): a `ParamLayout` in `layer.param_layouts`, read by `aserve.models.interface.ParamFiller`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import nn

from aserve.ops import cpu_gemm


@dataclass(frozen=True)
class ParamLayout:
    """How fused shards land in one checkpoint-layout parameter (see the module docstring)."""
    output_dim: int | None = 0
    pack_factor: int = 1
    fill_default: Callable[[torch.Tensor], None] | None = None  # fills it when the checkpoint lacks it


def add_checkpoint_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                         layout: ParamLayout = ParamLayout()) -> None:
    """Register a parameter in the checkpoint's layout and record its layout on the layer (attributes set on a
    parameter would not survive `loader.materialize`, which makes new ones)."""
    setattr(layer, name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
    layer.param_layouts[name] = layout


def replace_params(layer: nn.Module, **tensors: torch.Tensor | None) -> None:
    """Swap the layer's checkpoint-layout tensors for its compute-form ones (None deletes): after loading they are
    plain buffers, so nothing mistakes them for checkpoint parameters."""
    for name, tensor in tensors.items():
        if name in layer._parameters:
            del layer._parameters[name]
        if name in layer._buffers:
            del layer._buffers[name]
        if tensor is not None:
            layer.register_buffer(name, tensor)


class NativeProjection(NamedTuple):
    """A layer as the C++ layer loop (ops/csrc/decoder_stack.cpp) multiplies by it: the arguments of
    DecoderStack.add_projection. The same kernels, chosen by rows the same way, as the method's `projection`."""
    kind: int  # DENSE, INT8, INT4 or ONEDNN below
    weight: torch.Tensor  # the packed weight (aserve's GEMM or oneDNN's), or the int8 / int4 tiles
    scales: torch.Tensor | None  # int8: per-channel scales; int4: scales and scale * zero per group
    bias: torch.Tensor | None
    perm: torch.Tensor | None  # int4 act-order: the inputs' order
    group: int  # int4: inputs per group
    out_features: int
    kernel_rows: int  # int8 / int4: the row-at-a-time kernel up to here, the GEMM above
    activation: int = 0  # cpu_gemm.SILU_AND_MUL: a gated gate | up pack, whose projection is silu(gate) * up


DENSE, INT8, INT4, ONEDNN = 0, 1, 2, 3  # decoder_stack.cpp's Kind


class LinearMethod:
    """One weight format of `Linear` layers. Stateless per layer: what a layer needs lives on the layer."""

    name = "unquantized"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Register the layer's parameters in the checkpoint's layout, shapes from `layer.in_features` and
        `layer.output_sizes`, on the current device (meta while a model is built)."""
        raise NotImplementedError

    def process_after_loading(self, layer: nn.Module) -> None:
        """Turn the filled checkpoint tensors into what `apply` computes with."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], the layer's bias added."""
        raise NotImplementedError

    def prepack(self, layer: nn.Module, dtype: torch.dtype, gated: bool = False) -> bool:
        """Reorder the weight for the CPU's GEMM (ops.cpu_gemm) if this format can; whether it did. `gated`: the
        layer is a SwiGLU's gate | up, which the GEMM may pack for its SiLU-and-mul epilogue."""
        return False

    def silu_and_mul_projection(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """x [rows, in_features] -> silu(gate) * up of this gate | up layer, in its GEMM's epilogue, where `prepack`
        with `gated` packed it for that; None where it did not."""
        return None

    def projection(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """x [rows, in_features] -> `apply(layer, x)` for the flat forward (models.flat_forward), which calls it on
        the CPU with the kernels built, in the layer's dtype, no gradient recorded. A format may return a leaner
        function for those calls (its tensors bound once, no nn.Module attribute lookups), same result bit for bit."""
        return functools.partial(self.apply, layer)

    def native_projection(self, layer: nn.Module) -> NativeProjection | None:
        """What `projection` computes, as the C++ layer loop's arguments; None where that is not one of its
        kernels (the loop then runs in Python)."""
        return None

    def weight_bytes(self, layer: nn.Module) -> int:
        """What the layer's weights occupy once processed (for the start-up log)."""
        return sum(t.numel() * t.element_size() for name, t in layer.named_buffers(recurse=False)
                   if name != "bias") + sum(p.numel() * p.element_size() for name, p in
                                            layer.named_parameters(recurse=False) if name != "bias")


class UnquantizedLinearMethod(LinearMethod):
    """The dense weight [out, in] as the checkpoint holds it, prepacked for the CPU's GEMM at load."""

    name = "unquantized"

    def create_weights(self, layer, dtype):
        add_checkpoint_param(layer, "weight", (layer.out_features, layer.in_features), dtype)
        layer.packed = None

    def prepack(self, layer, dtype, gated=False):
        w = layer.weight
        if layer.packed is not None or w.dtype != dtype or w.device.type != "cpu" or not cpu_gemm.can_pack(dtype):
            return False
        layer.packed = (gated and layer.bias is None and cpu_gemm.pack_gated_weight(w)) or cpu_gemm.pack_weight(w)
        return True

    def silu_and_mul_projection(self, layer):
        packed = layer.packed
        if packed is None or not packed.gated:
            return None
        return functools.partial(cpu_gemm.packed_silu_and_mul, packed=packed)

    def apply(self, layer, x):
        if layer.packed is not None:
            return cpu_gemm.packed_linear(x, layer.packed, layer.bias)
        return nn.functional.linear(x, layer.weight, layer.bias)

    def projection(self, layer):
        if layer.packed is not None:
            return functools.partial(cpu_gemm.packed_linear, packed=layer.packed, bias=layer.bias)
        return super().projection(layer)

    def weight_bytes(self, layer):
        """As packed where aserve's GEMM reads it: its fp32 panels may be stored as bf16 (cpu_gemm.holds_bf16)."""
        if layer.packed is not None and layer.packed.aserve:
            return cpu_gemm.stored_bytes(layer.weight, layer.packed)
        return super().weight_bytes(layer)

    def native_projection(self, layer):
        if layer.packed is None:
            return None
        kind = DENSE if layer.packed.aserve else ONEDNN
        activation = cpu_gemm.SILU_AND_MUL if layer.packed.gated else 0  # its product only ever the SwiGLU's
        return NativeProjection(kind, layer.packed.data, None, layer.bias, None, 0, layer.out_features, 0, activation)


UNQUANTIZED = UnquantizedLinearMethod()
