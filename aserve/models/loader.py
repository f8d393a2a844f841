"""Load a model from a local Hugging Face folder: config.json, safetensors (single or sharded), tokenizer,
generation_config.json, and the FP8 KV cache scales a checkpoint may hold. Errors name the file or the field at
fault."""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from aserve.hardware import native, resolve_dtype
from aserve.models import parallel, weight_pages
from aserve.models.interface import CausalLM, ModelShape
from aserve.models.registry import (BARE_ARCHITECTURES, DECODER_CLASSIFIERS, architecture, model_class, read_config,
                                    read_json)
from aserve.ops.cpu_gemm import gemm_name, packing, prepack_linears
from aserve.pooling.params import num_labels
from aserve.quantization import resolve as resolve_quantization

log = logging.getLogger("aserve")

# A checkpoint's FP8 KV cache scales (vLLM's names): `...layers.N.self_attn.k_scale` / `v_scale`, or one
# `kv_scale` for both. They are not the model's weights: `fill_weights` skips them, `checkpoint_kv_scales` reads them.
KV_SCALE_NAME = re.compile(r"layers\.(\d+)\..*?\b(k_scale|v_scale|kv_scale)$")


@dataclass
class LoadedModel:
    model: CausalLM
    config: dict
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    dtype_reason: str = ""  # why this dtype (auto's choice from the hardware), for the start-up log


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


def checkpoint_names(files: list[Path]) -> Iterator[str]:
    """Every tensor name of the checkpoint, read from the files' headers only."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            yield from f.keys()


def checkpoint_tensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, tensor name, tensor) for every tensor of every file, read one at a time; errors name the file.
    `lazy`: safetensors slices instead, valid until the next one, from which a tensor-parallel rank reads only
    its part (models.parallel.Split)."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield file.name, name, f.get_slice(name) if lazy else f.get_tensor(name)


def fill_weights(model: CausalLM, files: list[Path], lazy: bool = False) -> None:
    current = [files[0].name]

    def tensors():
        for file_name, name, tensor in checkpoint_tensors(files, lazy):
            current[0] = file_name
            if not KV_SCALE_NAME.search(name):
                yield name, tensor
    try:
        model.load_weights(tensors())
    except ValueError as exc:
        where = current[0] if "lacks weights" not in str(exc) else f"checkpoint in {files[0].parent}"
        raise ValueError(f"{where}: {exc}") from None


def checkpoint_kv_scales(model_dir: str | Path) -> dict[int, tuple[float, float]]:
    """{layer: (k_scale, v_scale)} from the checkpoint's safetensors, for the layers that have them: an FP8 KV
    cache's scales (attention.kv_quant.set_scales gives them to the attention layers)."""
    found: dict[int, dict[str, float]] = {}
    for file in checkpoint_files(Path(model_dir)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                m = KV_SCALE_NAME.search(name)
                if m:
                    found.setdefault(int(m.group(1)), {})[m.group(2)] = float(f.get_tensor(name).float().reshape(-1)[0])
    scales = {}
    for layer, named in found.items():
        both = named.get("kv_scale", 1.0)
        scales[layer] = (named.get("k_scale", both), named.get("v_scale", both))
    if scales:
        log.info("KV cache scales for %d layers from the checkpoint", len(scales))
    return scales


def model_shape(model_dir: str | Path) -> ModelShape:
    """A folder's model shape from its config.json alone (the model built on the meta device: no weights read)."""
    config = read_config(Path(model_dir))
    with torch.device("meta"):
        return model_class(architecture(config)).from_config(config).shape


def load_model(model_dir: str | Path, dtype: str = "auto", device: torch.device = torch.device("cpu"),
               max_model_len: int | None = None, quantization: str | None = None,
               quantize_lm_head: bool = False, tp: parallel.TensorParallel | None = None,
               stage: parallel.PipelineStage | None = None, large_steps: bool = False) -> LoadedModel:
    """`tp`: this rank's tensor-parallel group; `stage`: its pipeline stage. The model holds (and reads from the
    files) only its slices of its stage's layers. `large_steps`: every step will be large (the pooling runner), which
    picks the GEMM its weights are packed for (cpu_gemm.gemm_for)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    arch = architecture(config)
    cls = model_class(arch)
    if arch in BARE_ARCHITECTURES or arch in DECODER_CLASSIFIERS:  # no LM head in the files: never asked for logits
        config = {**config, "tie_word_embeddings": True}
    spec = resolve_quantization(config, quantization, quantize_lm_head)
    tp, stage = tp or parallel.SINGLE, stage or parallel.WHOLE
    parallel.check_model(cls, config, tp.size, spec)
    if spec is not None:
        from aserve.quantization import loading

        loading.check_device(spec, device)
    torch_dtype, reason = resolve_dtype(dtype, config, device)
    files = checkpoint_files(model_dir)
    names = set(checkpoint_names(files)) if spec is not None else set()
    if "lm_head.qweight" in names:  # a quantized head (GPTQModel's lm_head=True) stands apart from the embedding
        config = {**config, "tie_word_embeddings": False}
    with torch.device("meta"), parallel.building(tp, stage):
        model = cls.from_config(config)
        if arch in DECODER_CLASSIFIERS:
            model.add_classifier(num_labels(config))
        model = model.to(torch_dtype)
        if spec is not None:  # before the weights are allocated: a GPTQ/AWQ layer never holds a dense one
            method = loading.attach(model, spec, torch_dtype, names)
    model = materialize(model, device)
    fill_weights(model, files, lazy=tp.size > 1 or stage.size > 1)
    if spec is not None:
        loading.finish(model, spec, method, torch_dtype)
    with device:  # tables made here (rotary cos/sin) are plain tensors that .to() would not move
        model.prepare(max_model_len or 0, torch_dtype)
    model.eval().requires_grad_(False)
    if hasattr(model, "sep_token_id") and model.sep_token_id is None:  # an encoder reading segments off [SEP]
        model.sep_token_id = load_tokenizer(model_dir).sep_token_id
    if device.type == "cpu" and native(torch_dtype, device) and os.environ.get("ASERVE_PREPACK", "1") != "0":
        with packing(large_steps):
            packed = prepack_linears(model, torch_dtype)
        if packed:
            log.info("prepacked %d linear layers for %s (%s)", packed, gemm_name(torch_dtype, large_steps),
                     str(torch_dtype).replace("torch.", ""))
    if device.type == "cpu":
        moved = weight_pages.weights_in_huge_pages(model)
        if moved:
            log.info("weights: %.1f MiB in memory advised for 2 MiB pages", moved / 2**20)

    eos: set[int] = set()
    for source in (config, _optional_json(model_dir / "generation_config.json")):
        value = source.get("eos_token_id")
        eos.update([value] if isinstance(value, int) else (value or []))
    return LoadedModel(model, config, torch_dtype, frozenset(eos), reason)


def materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to_empty(device)` without its cost: to_empty's `empty_like` of a meta tensor runs torch's Python
    reference for strides, whose first call imports sympy (0.4 s of every engine start on a slow CPU). The meta
    tensors here are all contiguous, so a plain `torch.empty` of each is the same."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _optional_json(path: Path) -> dict:
    return read_json(path) if path.is_file() else {}


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer, PretrainedConfig

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    # Where tokenizer_config.json names the tokenizer class, AutoTokenizer reads the model's config only for its
    # model_type. Handed the base config class then, it skips AutoConfig, whose model-specific config modules
    # import torch._dynamo: 1.2 s of every start-up. (Without a named class it maps the config's own class to a
    # tokenizer, so that case keeps AutoConfig.)
    config_file, tokenizer_config = Path(path) / "config.json", _optional_json(Path(path) / "tokenizer_config.json")
    config = (PretrainedConfig.from_dict(read_json(config_file))
              if config_file.is_file() and tokenizer_config.get("tokenizer_class") else None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), config=config)
    except Exception as exc:
        raise ValueError(f"could not load the tokenizer files in {path}: {exc}") from exc
    # Prompt length is the engine's to check (max_model_len, with a clear 400), not the tokenizer's to warn about.
    tokenizer.model_max_length = 1 << 62
    return tokenizer
