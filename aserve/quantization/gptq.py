"""GPTQ 4-bit checkpoints (AutoGPTQ, GPTQModel), as they store each quantized linear layer W [out, in]:

- `qweight` int32 [in / 8, out]: packed along the inputs, input 8r + j of output c in bits 4j..4j+3 of [r, c];
- `qzeros` int32 [groups, out / 8]: packed along the outputs the same way; checkpoint_format `gptq` (v1, the
  historical one) stores each zero point minus one, `gptq_v2` the zero point itself;
- `scales` [groups, out], fp16 in practice; `g_idx` int32 [in]: each input's group, i // group_size unless the
  checkpoint was quantized in act-order (desc_act), when inputs were visited by decreasing Hessian diagonal.

w[c, i] = (q[i, c] - z[g_idx[i], c]) * s[g_idx[i], c]. Shards of a fused projection concatenate along the outputs:
dim 1 of all three (qzeros eight outputs per element); q, k and v (or gate and up) see the same inputs, so
their g_idx agree and one copy serves the fused layer.
"""
from __future__ import annotations

import torch

from aserve.quantization import int4
from aserve.quantization.base import ParamLayout, add_checkpoint_param


class GPTQLinearMethod(int4.PackedInt4Method):
    name = "gptq"

    def create_weights(self, layer, dtype):
        k, n, group = layer.in_features, layer.out_features, self.spec.group_size
        if k % 8 or n % 8:
            raise ValueError(f"a GPTQ layer of {k} inputs and {n} outputs: both must be multiples of 8")
        groups = 1 if group == -1 else -(-k // group)
        add_checkpoint_param(layer, "qweight", (k // 8, n), torch.int32, ParamLayout(output_dim=1))
        add_checkpoint_param(layer, "qzeros", (groups, n // 8), torch.int32, ParamLayout(output_dim=1, pack_factor=8))
        add_checkpoint_param(layer, "scales", (groups, n), torch.float32, ParamLayout(output_dim=1))
        add_checkpoint_param(layer, "g_idx", (k,), torch.int32, ParamLayout(
            output_dim=None, fill_default=lambda t: t.copy_(int4.group_index(k, group, t.device))))

    def process_after_loading(self, layer):
        codes = int4.unpack_int32(layer.qweight.data, dim=0).t()  # [out, in]
        zeros = int4.unpack_int32(layer.qzeros.data, dim=1)
        if self.spec.zero_plus_one:
            zeros = (zeros + 1) & 15
        self.finish(layer, codes, zeros, layer.scales.data, layer.g_idx.data)
