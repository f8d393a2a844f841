"""Load a model from a local Hugging Face folder: config.json, safetensors (single or sharded), tokenizer,
generation_config.json. Errors name the file or the field at fault."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from aserve.hardware import resolve_dtype
from aserve.models.llama import LlamaForCausalLM
from aserve.models.qwen2 import Qwen2ForCausalLM
from aserve.models.qwen3 import Qwen3ForCausalLM

log = logging.getLogger("aserve")

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: dict
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    dtype_reason: str = ""  # why this dtype (auto's choice from the hardware), for the start-up log


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found in {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def checkpoint_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise ValueError(f"{index}: weight_map is empty")
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} names shard(s) missing from {model_dir}: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def load_weights(model: LlamaForCausalLM, files: list[Path], dtype: torch.dtype) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = model.checkpoint_name(name)
                if target is None:
                    continue
                ours, shard = target
                if ours not in params:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r} for {type(model).__name__}")
                param = params[ours]
                tensor = f.get_tensor(name)
                if shard is None:
                    dest = param.data
                else:
                    sizes = model.shard_sizes(ours)
                    dest = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the config implies {tuple(dest.shape)}")
                dest.copy_(tensor.to(dtype))
                loaded.add((ours, shard))
    for ours, param in params.items():
        shards = range(len(model.shard_sizes(ours))) if ("qkv_proj" in ours or "gate_up_proj" in ours) else [None]
        for shard in shards:
            if (ours, shard) not in loaded:
                raise ValueError(f"checkpoint in {files[0].parent} lacks weights for {ours!r}"
                                 + (f" (shard {shard})" if shard is not None else ""))


def load_model(model_dir: str | Path, dtype: str = "auto", device: torch.device = torch.device("cpu"),
               max_model_len: int | None = None) -> LoadedModel:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist")
    config = read_json(model_dir / "config.json")
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"config.json: architectures {archs} not supported; supported: {', '.join(ARCHITECTURES)}")
    torch_dtype, reason = resolve_dtype(dtype, config, device)
    cls = ARCHITECTURES[arch]
    args = cls.args_from_config(config)
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = cls(args)
    model = model.to_empty(device=device).to(torch_dtype)
    load_weights(model, files, torch_dtype)
    model.init_rope(max(max_model_len or 0, args.max_position_embeddings), torch_dtype)
    model.eval().requires_grad_(False)

    eos: set[int] = set()
    for source in (config, _optional_json(model_dir / "generation_config.json")):
        value = source.get("eos_token_id")
        eos.update([value] if isinstance(value, int) else (value or []))
    return LoadedModel(model, config, torch_dtype, frozenset(eos), reason)


def _optional_json(path: Path) -> dict:
    return read_json(path) if path.is_file() else {}


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"could not load the tokenizer files in {path}: {exc}") from exc
    # Prompt length is the engine's to check (max_model_len, with a clear 400), not the tokenizer's to warn about.
    tokenizer.model_max_length = 1 << 62
    return tokenizer
