"""A Llama-family decoder stack run as one straight loop of aserve's CPU kernels and the packed GEMMs.

Through the modules (llama.DecoderLayer and what it calls), every op of every layer first asks which path it
takes: the device, the dtype, the cache format, whether the kernels are built, whether the weight is packed;
then nn.Module's call machinery runs around it. On the CPU that Python is a fixed few milliseconds a step. Where
every answer is the same for the whole model (the CPU kernels built, every linear layer one of aserve's, dense
or quantized, one rank), `FlatForward` asks once, at the model's first step, and a step whose attention the kernels
take (decode rows and prefill chunks, over a cache in the model's dtype or FP8: the kernels read and write FP8 bytes
by the format's code and each layer's scales) is the same ops in the same order with nothing between them: bit for
bit the modules' output (tests/test_flat_forward.py). Anything else (another layer type, another attention backend)
goes through the modules as before. The model says what its layers
are: it builds one `FlatLayer` per layer (llama.LlamaForCausalLM.flat_layers), all the loop reads of them.

Where every projection is one of the packed kernels (`LinearMethod.native_projection`: dense weights packed for
aserve's GEMM or oneDNN's, int8, int4), the same loop runs in C++ (`native_stack`, ops/csrc/decoder_stack.cpp), one call a step instead of ~16 op calls a
layer from Python; the Python loop below runs the steps that carry LoRA adapters, and models with other projections.
Bench model, batch 1, `tools/step_ab.py --compare native --requests 1 --steps 200` (AMD EPYC Zen 5, avx2 avx512f
avx512_bf16, 2 threads, bf16, commit 3ae7c96): 7.21 against 8.16 ms a step dense, 4.88 against 5.77 int8, 4.61 against 5.53 GPTQ;
batch 64 31.65 against 33.29. `ASERVE_NATIVE_LOOP=0` keeps the Python loop.
With the model's head one of those kernels too (`native_head`), whole decode steps of rows that take their tokens
from the logits and nothing else (greedy, or a draw over a temperature) run in one call, embedding to tokens, several
steps at once with multi-step decoding (`decode_steps`, called by the model runner).

Bench model (30 layers), 2 threads on an AMD EPYC (avx512_bf16), commit 1958b65, a decode step with the flat path
on and off in alternate pairs of steps of one engine (tools/step_ab.py --compare flat): batch 64 bf16 81.8 against
89.7 ms and 96.7 against 101.1 (two runs), fp32 173.3 against 180.8; batch 1 bf16 23.8 against 27.6 ms.
`ASERVE_FLAT_FORWARD=0` turns it off.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
from torch import nn

from aserve.attention import Attention, kv_quant
from aserve.attention.torch_backend import TorchAttentionBackend
from aserve.models.layers import RMSNorm
from aserve.ops import cpu_kernels
from aserve.ops.cpu_gemm import PackedLinear
from aserve.quantization.base import DENSE, ONEDNN, LinearMethod, NativeProjection

UNBUILT = object()  # a model's `flat` before its first step


def projection(linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> x W^T + b of an aserve Linear, without nn.Module's call machinery: what its method makes of it (the packed
    GEMM of a dense prepacked layer, int8's tiled kernel, torch's int4 one, ...), so that quantized models take the
    loop too. None for anything else (a plain nn.Linear)."""
    method = getattr(linear, "method", None)
    return method.projection(linear) if isinstance(method, LinearMethod) else None


def native_projection(linear) -> NativeProjection | None:
    """The same projection as the C++ loop's arguments (LinearMethod.native_projection, or a PackedLinear's: a tied
    head's packed copy); None where it has none."""
    if isinstance(linear, PackedLinear):
        return NativeProjection(DENSE if linear.packed.aserve else ONEDNN, linear.packed.data, None, linear.bias, None,
                                0, linear.out_features, 0)
    method = getattr(linear, "method", None)
    return method.native_projection(linear) if isinstance(method, LinearMethod) else None


class FlatLayer(NamedTuple):
    """One pre-norm decoder layer as the loop runs it: x + attn(norm_in(x)), then + the SwiGLU MLP of
    norm_post(.). The model that owns the layers builds it (`of`, from its parts); the loop unpacks it in this order
    every step, as fast as a plain tuple. Each projection is a function of x alone (see `projection`)."""
    norm_in: RMSNorm
    qkv: Callable[[torch.Tensor], torch.Tensor]  # q | k | v fused
    q_size: int  # this layer's query features, then kv_size of keys and of values, in qkv's output
    kv_size: int
    attn: Attention  # heads, scale, sliding window and KV scales
    q_norm: RMSNorm | None  # Qwen3: RMSNorm over each head's queries and keys; None elsewhere
    k_norm: RMSNorm | None
    o: Callable[[torch.Tensor], torch.Tensor]
    norm_post: RMSNorm
    gate_up: Callable[[torch.Tensor], torch.Tensor]  # gate | up fused
    gated: Callable[[torch.Tensor], torch.Tensor]  # silu(gate) * up: in the GEMM's epilogue where it can be
    down: Callable[[torch.Tensor], torch.Tensor]
    loras: tuple | None  # with LoRA on: the LoRA deltas (lora.layers.LoRALinear) of qkv, o, gate_up and down
    natives: tuple[NativeProjection, ...] | None  # qkv, o, gate_up, down for the C++ loop; None: it cannot run them

    @classmethod
    def of(cls, norm_in: nn.Module, qkv_proj: nn.Module, q_size: int, kv_size: int, attn: Attention,
           q_norm: nn.Module | None, k_norm: nn.Module | None, o_proj: nn.Module, norm_post: nn.Module,
           gate_up_proj: nn.Module, down_proj: nn.Module, dtype: torch.dtype) -> "FlatLayer | None":
        """The record of a layer whose parts the loop runs as they are; None where one is not: a linear layer
        with no `projection`, a norm of another kind or dtype, soft-capped attention logits."""
        linears = [projection(x) for x in (qkv_proj, o_proj, gate_up_proj, down_proj)]
        norms = [norm_in, norm_post] + ([q_norm, k_norm] if q_norm is not None else [])
        if (any(x is None for x in linears) or attn.logit_softcap
                or any(type(n) is not RMSNorm or n.weight.dtype != dtype for n in norms)):
            return None
        qkv, o, gate_up, down = linears
        gated = getattr(gate_up_proj, "silu_and_mul_fused", None)  # in the GEMM's epilogue (Linear.prepack)
        if gated is None:
            def gated(x, gate_up=gate_up):
                return torch.ops.aserve.silu_and_mul(gate_up(x))
        loras = tuple(getattr(x, "lora", None) for x in (qkv_proj, o_proj, gate_up_proj, down_proj))
        if any(lora is None for lora in loras):
            if any(lora is not None for lora in loras):  # LoRA on some of the four only: not this loop's shape
                return None
            loras = None
        natives = tuple(native_projection(x) for x in (qkv_proj, o_proj, gate_up_proj, down_proj))
        return cls(norm_in, qkv, q_size, kv_size, attn, q_norm, k_norm, o, norm_post, gate_up, gated, down, loras,
                   None if None in natives else natives)


class FlatForward:
    """The decoder stack's forward for the steps it takes (`takes`); built by `build`, or None where the model
    has anything the loop does not run."""

    def __init__(self, model, layers: list[FlatLayer]):
        self.embed = model.embed_tokens.weight if model.embed_tokens is not None else None
        self.rope = model.rope
        self.norm = model.norm  # None on a pipeline stage before the last
        self.layers = layers
        self.stack = native_stack(layers, model.rope)  # the same loop in C++, where it runs every projection
        self.stack_caches = None  # the kv_caches list whose tensors the stack holds
        self.stack_kv_format = 0  # the cache format the stack was told of (an FP8 format's code; 0: the model's dtype)
        head = None if self.stack is None or self.embed is None or self.norm is None else model.native_head()
        if head is not None:  # what decode_steps runs after the layers: the last norm, the logits, the tokens
            self.stack.set_head(self.embed.contiguous(), self.norm.weight, self.norm.eps,
                                self.stack.add_projection(*head))
        self.has_head = head is not None

    @classmethod
    def build(cls, model: nn.Module) -> "FlatForward | None":
        """`model`: a decoder stack with `embed_tokens`, `rope`, `norm`, `tp` and `flat_layers(dtype)`, which
        gives each layer's FlatLayer, or None where one is not this block (llama.LlamaForCausalLM)."""
        if os.environ.get("ASERVE_FLAT_FORWARD", "1") == "0" or model.tp.size != 1:
            return None
        embed = model.embed_tokens
        if (embed is not None and type(embed) is not nn.Embedding) or model.rope is None or not cpu_kernels.available():
            return None
        weight = next(model.parameters())
        dtype = weight.dtype
        if weight.device.type != "cpu" or dtype not in cpu_kernels.KERNEL_DTYPES or model.rope.cos.dtype != dtype:
            return None
        layers = model.flat_layers(dtype)
        return None if layers is None else cls(model, layers)

    @staticmethod
    def takes(meta) -> bool:
        """Whether the kernels take this step's attention: a cache (in the model's dtype, or FP8) read by the torch
        backend, with no gradient recorded (the kernels have none). Decode rows and prefill chunks alike."""
        backend = getattr(meta, "backend", None)
        return not torch.is_grad_enabled() and isinstance(backend, TorchAttentionBackend)

    def stack_takes(self, fmt: kv_quant.FP8Format | None) -> bool:
        """Whether the C++ loop can run a step over a cache of format `fmt`: any, once every layer has its FP8
        scales (a layer estimating its own from its first batch does so in the Python loop), told to the stack once."""
        code = 0 if fmt is None else fmt.code
        if code == self.stack_kv_format:
            return True
        if any(layer.attn.kv_scales_pending for layer in self.layers):
            return False
        self.stack.set_kv_format(code, [s for layer in self.layers for s in (layer.attn.k_scale, layer.attn.v_scale)])
        self.stack_kv_format = code
        return True

    def decode_steps(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     tables: torch.Tensor, contexts: torch.Tensor, kv_caches, backend,
                     uniforms: torch.Tensor | None = None, temperatures: torch.Tensor | None = None,
                     drawn: torch.Tensor | None = None) -> torch.Tensor | None:
        """Decode steps of decode rows in one call of the C++ stack (DecoderStack.decode_steps): [steps, rows]
        tokens, -1 from the first step with a row nothing could be sampled from; positions, slots and context
        lengths [steps, rows], `tables` [rows, width] holding every step's blocks; greedy, or the rows `drawn` (all
        where None) drawn with `uniforms` [steps, drawn] over `temperatures` (sampler.step_draws), the others
        greedy. The tokens are those of the steps through this
        forward, the model's compute_logits and the sampler. None where the stack cannot run them: no stack or
        head, another attention backend, FP8 scales still to estimate, or LoRA adapters in the step."""
        fmt = backend.kv_format if isinstance(backend, TorchAttentionBackend) else None
        loras = self.layers[0].loras
        if (not self.has_head or not isinstance(backend, TorchAttentionBackend) or torch.is_grad_enabled()
                or (loras is not None and loras[0].step.token_slot is not None) or not self.stack_takes(fmt)):
            return None
        self.use_caches(kv_caches)
        return self.stack.decode_steps(token_ids, positions, slots, tables, contexts, uniforms, temperatures, drawn)

    def use_caches(self, kv_caches) -> None:
        """The stack's layers read and write these caches (told once a list)."""
        if kv_caches is not self.stack_caches:
            self.stack.set_caches([cache for pair in kv_caches for cache in pair])
            self.stack_caches = kv_caches

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta, intermediate=None):
        """As the model's forward: `intermediate` from the pipeline stage before, and a stage before the last
        returns its own (the last layer's output, the running sum) instead of normed hidden states."""
        ops = torch.ops.aserve
        nd = meta.num_decode_tokens
        prefill = meta.prefill_batch() if meta.prefills else None
        slots, cos, sin, rotary_dim = meta.slot_mapping, self.rope.cos, self.rope.sin, self.rope.rotary_dim
        x, residual = (nn.functional.embedding(input_ids, self.embed), None) if intermediate is None else intermediate
        loras = self.layers[0].loras
        fmt = meta.backend.kv_format  # an FP8 cache's format, else None
        code = 0 if fmt is None else fmt.code
        if (self.stack is not None and (loras is None or loras[0].step.token_slot is None)
                and self.stack_takes(fmt)):
            self.use_caches(kv_caches)
            x, residual = self.stack.forward(x, residual, positions, slots, nd, meta.decode_tables if nd else None,
                                             meta.decode_context if nd else None, *(prefill or (None, None, None)))
            return self.finish(x, residual)
        T = x.shape[0]
        for (norm_in, qkv_proj, q_size, kv_size, attn, q_norm, k_norm, o_proj, norm_post, gate_up_proj, gated,
             down_proj, loras, _), (k_cache, v_cache) in zip(self.layers, kv_caches):
            if loras is not None and loras[0].step.token_slot is None:  # no adapter in this step
                loras = None
            if residual is None:
                residual, x = x, ops.rms_norm(x, norm_in.weight, norm_in.eps)
            else:
                x = ops.add_rms_norm(x, residual, norm_in.weight, norm_in.eps)
            qkv = qkv_proj(x)
            if loras is not None:
                qkv = loras[0].forward(x, qkv)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
            q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
            if q_norm is not None:  # Qwen3: RMSNorm over each head's features
                q = ops.rms_norm(q.reshape(-1, D), q_norm.weight, q_norm.eps).view(T, H, D)
                k = ops.rms_norm(k.reshape(-1, D), k_norm.weight, k_norm.eps).view(T, Hkv, D)
            ops.rotary_embedding(positions, q, k, cos, sin, rotary_dim)
            if fmt is not None and attn.kv_scales_pending:  # as kv_quant.write: from the layer's first batch
                kv_quant.estimate_scales(attn, k, v, fmt)
            ops.write_kv(k, v, k_cache, v_cache, slots, attn.k_scale, attn.v_scale, code, True)
            out, window = torch.empty(T, H, D, dtype=x.dtype), attn.sliding_window or 0
            if nd:
                ops.paged_decode_attention(out[:nd], q[:nd], k_cache, v_cache, meta.decode_tables, meta.decode_context,
                                           attn.scale, window, 0.0, attn.k_scale, attn.v_scale, code)
            if prefill is not None:
                ops.paged_prefill_attention(out[nd:], q[nd:], k_cache, v_cache, *prefill, attn.scale, window, 0.0,
                                            attn.k_scale, attn.v_scale, code)
            out = out.view(T, H * D)
            o = o_proj(out)
            x = ops.add_rms_norm(o if loras is None else loras[1].forward(out, o), residual, norm_post.weight,
                                 norm_post.eps)
            if loras is None:
                act = gated(x)
            else:
                act = ops.silu_and_mul(loras[2].forward(x, gate_up_proj(x)))
            down = down_proj(act)
            x = down if loras is None else loras[3].forward(act, down)
        return self.finish(x, residual)

    def finish(self, x: torch.Tensor, residual: torch.Tensor):
        """The final norm; a pipeline stage before the last hands on (x, residual) instead."""
        if self.norm is None:
            return x, residual
        return torch.ops.aserve.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)


def native_stack(layers: list[FlatLayer], rope):
    """torch.classes.aserve.DecoderStack (ops/csrc/decoder_stack.cpp) holding the layers, or None where one has a
    projection it cannot run (or the kernels lack aserve's GEMMs). ASERVE_NATIVE_LOOP=0 keeps the Python loop."""
    if (os.environ.get("ASERVE_NATIVE_LOOP", "1") == "0" or any(layer.natives is None for layer in layers)
            or not hasattr(torch.ops.aserve, "gemm_packed")):
        return None
    stack = torch.classes.aserve.DecoderStack(rope.cos, rope.sin, rope.rotary_dim)
    for layer in layers:
        qkv, o, gate_up, down = (stack.add_projection(*p) for p in layer.natives)
        attn, q_norm, k_norm = layer.attn, layer.q_norm, layer.k_norm
        stack.add_layer(layer.norm_in.weight, layer.norm_in.eps, qkv, layer.q_size, layer.kv_size, attn.num_heads,
                        attn.num_kv_heads, attn.head_dim, attn.scale, attn.sliding_window or 0, attn.k_scale,
                        attn.v_scale, None if q_norm is None else q_norm.weight, 0.0 if q_norm is None else q_norm.eps,
                        None if k_norm is None else k_norm.weight, 0.0 if k_norm is None else k_norm.eps, o,
                        layer.norm_post.weight, layer.norm_post.eps, gate_up, down)
    return stack
