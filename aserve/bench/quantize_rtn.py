"""Write a GPTQ- or AWQ-format 4-bit copy of a 16/32-bit checkpoint by round-to-nearest (no calibration data), so
the int4 loading path can be measured on any model (`aserve bench quality --quantization gptq|awq`, or
`python -m aserve.bench.quantize_rtn SRC DST --method gptq|awq` to keep the copy). A measuring tool, not the
runtime's: it lives with the bench command that writes these copies, above the loader it reads checkpoints with.

Each linear layer's weight inside the decoder (and, with `lm_head`, the logits projection: the embedding's values
where they are tied, written as `lm_head.*` beside the dense embedding, with `"lm_head": true` in the config, as
GPTQModel writes a head it quantized) is quantized per group of inputs as
GPTQ's own quantizer does it: the range [min(w, 0), max(w, 0)] split into 15 steps, scale = range / 15 (stored in
fp16, and the codes computed against the stored scale), zero = round(-min / scale), q = clamp(round(w / scale) +
zero, 0, 15). The files follow the formats' definitions in quantization/gptq.py and awq.py (GPTQ as checkpoint_format
`gptq`, zero points stored minus one).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from aserve.models.layers import Linear
from aserve.models.loader import checkpoint_files, checkpoint_tensors
from aserve.models.registry import architecture, model_class, read_config
from aserve.quantization import awq
from aserve.quantization.int4 import pack_int32

GROUP_SIZES = (128, 64, 32)


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] in 0..15, zeros [groups, out], scales [groups, out] fp16) of a weight [out, in]."""
    out_features, in_features = weight.shape
    w = weight.float().view(out_features, in_features // group_size, group_size)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    flat = (low == 0) & (high == 0)
    low, high = torch.where(flat, -1.0, low), torch.where(flat, 1.0, high)
    scales = ((high - low) / 15).half()
    zeros = torch.round(-low / scales.float()).clamp(0, 15)
    codes = torch.clamp(torch.round(w / scales.float()[..., None]) + zeros[..., None], 0, 15)
    return codes.view(out_features, in_features).to(torch.int32), zeros.t().to(torch.int32), scales.t().contiguous()


def pack_gptq(codes, zeros, scales, group_size: int) -> dict[str, torch.Tensor]:
    in_features = codes.shape[1]
    return {"qweight": pack_int32(codes.t().contiguous(), dim=0),
            "qzeros": pack_int32((zeros - 1) & 15, dim=1),  # v1: each zero point minus one
            "scales": scales,
            "g_idx": torch.arange(in_features, dtype=torch.int32) // group_size}


def pack_awq(codes, zeros, scales, group_size: int) -> dict[str, torch.Tensor]:
    def interleave(values):  # [rows, out] -> the j-th nibble of each eight holds output ORDER[j]
        return values.view(values.shape[0], -1, 8)[:, :, list(awq.ORDER)].reshape(values.shape[0], -1)
    return {"qweight": pack_int32(interleave(codes.t().contiguous()), dim=1),
            "qzeros": pack_int32(interleave(zeros), dim=1), "scales": scales}


def write_rtn_checkpoint(src: str | Path, dst: str | Path, method: str, group_size: int | None = None,
                         lm_head: bool = False) -> int:
    """Write `src` quantized to `method` (gptq or awq; `lm_head`: the head too, gptq only) into `dst`; return the
    group size used (by default the largest of 128, 64, 32 that divides every quantized layer's inputs)."""
    if lm_head and method != "gptq":
        raise ValueError("only GPTQ checkpoints carry a quantized LM head (AutoAWQ leaves it dense)")
    src, dst = Path(src), Path(dst)
    config = read_config(src)
    arch = architecture(config)
    if arch == "GPT2LMHeadModel":
        raise ValueError("GPT-2 stores Conv1D weights [in, out]; the round-to-nearest writer handles [out, in] ones")
    with torch.device("meta"):
        model = model_class(arch).from_config(config)
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"}
    files = checkpoint_files(src)
    tensors = {name: tensor for _, name, tensor in checkpoint_tensors(files)}
    if lm_head:
        output = next(name for name, p in model.named_parameters() if p is model.output_weight())
        source = next(name for name in tensors if (model.checkpoint_name(name) or (None,))[0] == output)
        head = tensors[source]  # lm_head.weight, or the embedding a tied head reads

    def layer_of(name):
        target = model.checkpoint_name(name) if name.endswith(".weight") else None
        ours = target[0] if isinstance(target, tuple) else target
        return ours.rsplit(".", 1)[0] if ours and ours.rsplit(".", 1)[0] in linears else None

    chosen = [name for name in tensors if layer_of(name) is not None]
    inputs = {tensors[name].shape[1] for name in chosen} | ({head.shape[1]} if lm_head else set())
    if group_size is None:
        group_size = next((g for g in GROUP_SIZES if all(k % g == 0 for k in inputs)), None)
        if group_size is None:
            raise ValueError(f"no group size of {GROUP_SIZES} divides the layers' inputs {sorted(inputs)}")
    pack = pack_gptq if method == "gptq" else pack_awq
    quantized = {name: tensors[name] for name in chosen}
    if lm_head:
        quantized["lm_head.weight"] = head
    out = {name: tensor.contiguous() for name, tensor in tensors.items() if name not in quantized}
    for name, weight in quantized.items():
        prefix = name[:-len(".weight")]
        for piece, value in pack(*quantize_groups(weight, group_size), group_size).items():
            out[f"{prefix}.{piece}"] = value.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(item, dst / item.name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq", "lm_head": lm_head} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return group_size


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="write a round-to-nearest GPTQ or AWQ 4-bit copy of a checkpoint")
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--method", choices=("gptq", "awq"), default="gptq")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--lm-head", action="store_true",
                        help="quantize the LM head too (gptq; a tied head is written as its own lm_head.*)")
    args = parser.parse_args()
    group = write_rtn_checkpoint(args.src, args.dst, args.method, args.group_size, args.lm_head)
    head = ", LM head included" if args.lm_head else ""
    print(f"wrote {args.dst}: {args.method} int4, group size {group}{head}, round-to-nearest")


if __name__ == "__main__":
    main()
