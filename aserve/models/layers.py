"""Building blocks shared by the model families: linear layers, RMSNorm, rotary position embeddings, activations.

On the CPU, RMSNorm, the rotary embedding, SiLU-and-mul and an encoder's add-then-LayerNorm run as aserve's fused
kernels (ops.cpu_kernels) when those are built; the torch code beside each is the fallback and the reference they
are tested against.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn

from aserve.ops import cpu_gemm, cpu_kernels
from aserve.quantization.base import UNQUANTIZED, LinearMethod, ParamLayout, UnquantizedLinearMethod


class Linear(nn.Module):
    """y = x W^T + b, whatever form W takes: dense, int8 or GPTQ/AWQ int4 is the business of its `LinearMethod`
    (aserve.quantization), set once per model at load. `out_features` may be a list: the shards of a fused
    projection (q|k|v, gate|up), concatenated along the output dimension in that order."""

    def __init__(self, in_features: int, out_features: int | Sequence[int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = [out_features] if isinstance(out_features, int) else list(out_features)
        self.out_features = sum(self.output_sizes)
        self.param_layouts: dict[str, ParamLayout] = {"bias": ParamLayout()}
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        self.method: LinearMethod = UNQUANTIZED
        self.method.create_weights(self, torch.get_default_dtype())
        self.lora: nn.Module | None = None  # adapters' batched deltas (aserve.lora.layers), set when LoRA is on
        # x [rows, in] -> silu(gate) * up in the GEMM's epilogue, once prepack has packed a gate | up for it
        self.silu_and_mul_fused: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Trade the dense weight for `method`'s checkpoint tensors (before the weights are filled)."""
        for name in [n for n in self.param_layouts if n != "bias"]:
            self._parameters.pop(name, None)
            del self.param_layouts[name]
        self.method = method
        method.create_weights(self, dtype)

    def prepack(self, dtype: torch.dtype, gated: bool = False) -> bool:
        """Pack the weight for the CPU's GEMM where the method can; `gated`: this is a SwiGLU's gate | up (see
        forward_silu_and_mul)."""
        packed = self.method.prepack(self, dtype, gated)
        self.silu_and_mul_fused = self.method.silu_and_mul_projection(self)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.lora is None else self.lora(x, y)

    def _fusable(self) -> bool:
        """A dense weight packed for the CPU GEMM, no adapters: the GEMM can apply an epilogue."""
        return (self.lora is None and isinstance(self.method, UnquantizedLinearMethod)
                and getattr(self, "packed", None) is not None)

    def forward_gelu(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """activation(kind)(self(x)) for a GELU `kind` (gelu, gelu_new, gelu_pytorch_tanh), in the GEMM's epilogue
        where it can be (ops.cpu_gemm.packed_linear_gelu)."""
        if self._fusable() and kind in cpu_gemm.GELU_ALGORITHMS:
            return cpu_gemm.packed_linear_gelu(x, self.packed, self.bias, kind)
        return activation(kind)(self(x))

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate | up projection: in the GEMM's epilogue where the weight was packed for it
        (prepack with `gated`: ops.cpu_gemm.pack_gated_weight, or int8's gated tiles), else the product then
        silu_and_mul."""
        if self.lora is None and self.silu_and_mul_fused is not None:
            return self.silu_and_mul_fused(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return silu_and_mul(self(x))

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        """norm(self(x) + residual), an encoder's post-norm: the plain GEMM, then the add and the norm in one pass
        of aserve's kernel (add_layer_norm). With oneDNN's GEMM this beats the add in its epilogue then torch's
        LayerNorm: [7525, 768] rows of BERT-base, bf16, Xeon with AMX, 2 threads, 4.35 against 5.41 ms after the
        attention output, 16.76 against 18.79 after the MLP's down projection; `aserve bench embed`'s run 7.40
        against 7.80 s (alternated in one engine). One rounding more (the product to bf16 before the add), as in
        the reference models, whose dense layers round before the residual add."""
        return add_layer_norm(self(x), residual, norm)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, {self.method.name}"


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """norm(x + residual), written over `x` (which the caller gives up) where aserve's kernel runs."""
    if (norm.weight is not None and norm.bias is not None and x.dim() == 2 and x.stride(1) == 1
            and residual.shape == x.shape and residual.stride(1) == 1
            and x.dtype == residual.dtype == norm.weight.dtype and cpu_kernels.usable(x)):
        torch.ops.aserve.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)
        return x
    return norm(x + residual)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like the reference implementation. Given a decoder layer's running
    sum as `residual`, it first adds x to it and normalises the sum, returning (normed, sum): the residual add
    and the next norm in one pass of aserve's kernel (which updates `residual` in place)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if (x.dim() == 2 and residual.is_contiguous() and x.dtype == residual.dtype == self.weight.dtype
                    and cpu_kernels.usable(x)):
                return torch.ops.aserve.add_rms_norm(x, residual, self.weight, self.eps), residual
            residual = x + residual
            return self(residual), residual
        if x.dtype == self.weight.dtype and cpu_kernels.usable(x):
            return torch.ops.aserve.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one, and the product is taken in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


ACTIVATIONS = {
    "silu": nn.functional.silu,
    "relu": nn.functional.relu,
    "gelu": nn.functional.gelu,
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate | up) -> silu(gate) * up: SwiGLU's product."""
    if x.dim() == 2 and cpu_kernels.usable(x):
        return torch.ops.aserve.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json: activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def rope_parameters(config: dict) -> tuple[float, dict]:
    """(theta, scaling) from either the transformers 4 or the transformers 5 spelling of the config."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    merged["rope_type"] = rope_type
    return float(theta), merged


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling["rope_type"]
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"config.json: rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position; rotate-half convention. With a partial rotary
    factor (Phi-3's `partial_rotary_factor`) only the first `rotary_dim` features of each head rotate."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict, dtype: torch.dtype,
                 rotary_dim: int | None = None):
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = inverse_frequencies(self.rotary_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.partial = self.rotary_dim != head_dim
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D] and k [T, Hkv, D] rotated; on the fused path in place."""
        if q.dtype == self.cos.dtype and cpu_kernels.usable(q, k):
            torch.ops.aserve.rotary_embedding(positions, q, k, self.cos, self.sin, self.rotary_dim)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        if self.partial:
            r = self.rotary_dim
            return (torch.cat((q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]), dim=-1),
                    torch.cat((k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]), dim=-1))
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
