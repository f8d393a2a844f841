"""AWQ 4-bit checkpoints in AutoAWQ's GEMM layout, as they store each quantized linear layer W [out, in]:

- `qweight` int32 [in, out / 8]: packed along the outputs, eight to an int32 in AWQ's interleaved order: bits
  4j..4j+3 of element [i, c] hold output 8c + ORDER[j], ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
- `qzeros` int32 [groups, out / 8]: packed the same way, the zero points themselves;
- `scales` [groups, out], fp16 in practice; groups are consecutive runs of group_size inputs.

w[c, i] = (q[i, c] - z[i // group_size, c]) * s[i // group_size, c]. Shards of a fused projection concatenate
along the outputs: dim 1 of all three, eight outputs per packed element (the interleave never crosses a shard).
"""
from __future__ import annotations

import torch

from aserve.quantization import int4
from aserve.quantization.base import ParamLayout, add_checkpoint_param

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output (within its eight) held by the j-th nibble
UNDO = tuple(ORDER.index(j) for j in range(8))  # the nibble holding the j-th output: (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, out / 8] int32 in AWQ's order -> [rows, out] values in output order."""
    values = int4.unpack_int32(packed, dim=1).view(packed.shape[0], -1, 8)
    return values[:, :, list(UNDO)].reshape(packed.shape[0], -1)


class AWQLinearMethod(int4.PackedInt4Method):
    name = "awq"

    def create_weights(self, layer, dtype):
        k, n, group = layer.in_features, layer.out_features, self.spec.group_size
        if n % 8:
            raise ValueError(f"an AWQ layer of {n} outputs: AWQ packs eight outputs to an int32")
        groups = 1 if group == -1 else -(-k // group)
        packed = ParamLayout(output_dim=1, pack_factor=8)
        add_checkpoint_param(layer, "qweight", (k, n // 8), torch.int32, packed)
        add_checkpoint_param(layer, "qzeros", (groups, n // 8), torch.int32, packed)
        add_checkpoint_param(layer, "scales", (groups, n), torch.float32, ParamLayout(output_dim=1))

    def process_after_loading(self, layer):
        codes = unpack_awq(layer.qweight.data).t()  # [out, in]
        zeros = unpack_awq(layer.qzeros.data)
        self.finish(layer, codes, zeros, layer.scales.data, None)
