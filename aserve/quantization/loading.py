"""Applying a QuantSpec to a model built on the meta device: which `Linear` layers take the quantized method
(`attach`, before the weights are filled), and turning the filled checkpoint tensors into their compute form
(`finish`, after).

For int8 every linear layer but the logits projection is quantized (that one too with `quantize_lm_head`; when
it is tied to the embedding, a quantized copy serves as the head and the embedding stays as it is). For GPTQ and
AWQ the checkpoint says which: the layers whose tensors include a `qweight` (quantizers leave the head, and
whatever their config excluded, dense); `quantize_lm_head` makes a dense head int8 as above. A GPTQ checkpoint
quantized with its head (GPTQModel's `lm_head=True`: an `lm_head.qweight`) keeps that head in int4, apart from the
dense embedding even where config.json ties them (the loader builds such a model untied).
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from aserve.models.layers import Linear
from aserve.quantization import QuantSpec
from aserve.quantization.awq import AWQLinearMethod
from aserve.quantization.base import LinearMethod
from aserve.quantization.gptq import GPTQLinearMethod
from aserve.quantization.int8 import Int8LinearMethod

log = logging.getLogger("aserve")


def make_method(spec: QuantSpec, dtype: torch.dtype) -> LinearMethod:
    if spec.method == "int8":
        return Int8LinearMethod()
    return (GPTQLinearMethod if spec.method == "gptq" else AWQLinearMethod)(spec, dtype)


def check_device(spec: QuantSpec, device: torch.device) -> None:
    """Refuse, before any weight is read, a format with no kernel on this device."""
    if spec.method in ("gptq", "awq") and device.type != "cpu":
        raise ValueError(f"{spec.method} int4 weights have no {device.type} kernel in aserve yet (the linear-method "
                         "seam is aserve/quantization/int4.py); run them with --device cpu")


def prequantized_layers(model: nn.Module, checkpoint_names: Iterable[str]) -> set[str]:
    """Our names of the layers whose checkpoint tensors include a `qweight`."""
    found = set()
    for name in checkpoint_names:
        if name.endswith(".qweight"):
            target = model.checkpoint_name(name)
            ours = target[0] if isinstance(target, tuple) else target
            if ours is not None:
                found.add(ours.rsplit(".", 1)[0])
    return found


def attach(model: nn.Module, spec: QuantSpec, dtype: torch.dtype, checkpoint_names: Iterable[str]) -> LinearMethod:
    """Give the chosen `Linear` layers the quantized method (their checkpoint tensors replace the dense weight)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    if spec.method == "int8":
        chosen = {name for name in linears if name != "lm_head" or spec.quantize_lm_head}
    else:
        chosen = prequantized_layers(model, checkpoint_names)
        strangers = sorted(chosen - set(linears))
        if "lm_head" in strangers:
            raise ValueError(f"the checkpoint holds a {spec.method} LM head (lm_head.qweight), and "
                             f"{type(model).__name__} always ties its head to the embedding, so it has no head of "
                             "its own to load it into")
        if strangers:
            raise ValueError(f"the checkpoint holds {spec.method} tensors for {strangers[0]!r}, which is not a "
                             "linear layer of this model")
        if not chosen:
            raise ValueError(f"config.json says {spec.method}, but the checkpoint has no quantized layer (no "
                             "*.qweight tensor)")
    method = make_method(spec, dtype)
    for name in chosen:
        linears[name].set_method(method, dtype)
    if spec.quantize_lm_head and "lm_head" in linears and "lm_head" not in chosen:  # GPTQ/AWQ's dense head
        linears["lm_head"].set_method(Int8LinearMethod(), dtype)
    return method


def finish(model: nn.Module, spec: QuantSpec, method: LinearMethod, dtype: torch.dtype) -> None:
    """Quantize or repack every filled layer; with `quantize_lm_head`, give a tied head its own int8 copy."""
    head = getattr(model, "lm_head", None)
    layers = [m for m in model.modules() if isinstance(m, Linear) and (m.method is method or m is head and
                                                                       isinstance(m.method, Int8LinearMethod))]
    dense_bytes = sum(m.in_features * m.out_features for m in layers) * torch.finfo(dtype).bits // 8
    for layer in layers:
        layer.method.process_after_loading(layer)
    if spec.quantize_lm_head and getattr(model, "lm_head", 1) is None and model.output_weight() is not None:
        model.packed_head = quantized_copy(model.output_weight(),
                                           method if spec.method == "int8" else Int8LinearMethod())
        layers.append(model.packed_head)
        dense_bytes += model.packed_head.in_features * model.packed_head.out_features * torch.finfo(dtype).bits // 8
    stored = sum(layer.method.weight_bytes(layer) for layer in layers)
    log.info("quantization: %s, %d linear layers, their weights %.1f MiB (%.1f MiB dense)", spec.describe(),
             len(layers), stored / 2**20, dense_bytes / 2**20)
    refusals = getattr(method, "refusals", [])
    if refusals:
        log.warning("%d of %d %s layers run dequantized to dense weights (as fast as unquantized, no memory saved): "
                    "%s", len(refusals), len(layers), spec.method, refusals[0])


def quantized_copy(weight: torch.Tensor, method: LinearMethod) -> Linear:
    """A `Linear` computing x @ weight.T through `method`, made from `weight` without changing it."""
    with torch.device("meta"):
        head = Linear(weight.shape[1], weight.shape[0])
        head.set_method(method, weight.dtype)
    head.weight = nn.Parameter(weight.detach(), requires_grad=False)
    method.process_after_loading(head)
    return head
