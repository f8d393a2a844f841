"""A PEFT LoRA adapter folder: read its config, refuse what aserve cannot serve (in one line, before any tensor is
loaded), and load its A/B weights keyed by (layer, module) with each module's scale folded in.

The model's side is plain data, `targets`: the module names aserve can adapt (q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj) with their (in, out) features, and its number of layers; the worker reports them
(lora.layers.target_shapes), so the core checks an adapter without the model at hand.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aserve.errors import InvalidRequestError
from aserve.lora.request import LoRAFacts, LoRARequest, ResolvedLoRA

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TENSOR_NAME = re.compile(r"base_model\.model\.(?P<module>.+\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                         r"(?P<name>[a-z_]+))\.lora_(?P<part>[AB])\.weight")
MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _refuse(path: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {path}: {reason}", "lora_request")


@dataclass
class AdapterConfig:
    """What aserve reads of adapter_config.json."""
    path: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str] | str
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_and_scale(self, module_key: str) -> tuple[int, float]:
        """The rank and scale PEFT gives `module_key` (e.g. model.layers.0.self_attn.q_proj): a pattern key matches
        as a regex on the name's tail, the first that matches wins (peft.utils.other.get_pattern_key)."""
        r = next((v for k, v in self.rank_pattern.items() if re.match(rf"(.*\.)?({k})$", module_key)), self.r)
        alpha = next((v for k, v in self.alpha_pattern.items() if re.match(rf"(.*\.)?({k})$", module_key)),
                     self.lora_alpha)
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)

    def targets(self, module_key: str) -> bool:
        """Whether PEFT would adapt this module (peft.tuners.tuners_utils.check_target_module_exists)."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_key) is not None
        return any(module_key == t or module_key.endswith("." + t) for t in self.target_modules)


def read_config(path: str, max_rank: int) -> AdapterConfig:
    """Parse and check adapter_config.json; what aserve does not serve is refused here."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise _refuse(path, f"no {CONFIG_FILE} (a PEFT adapter folder is expected)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(path, f"cannot read {CONFIG_FILE}: {exc}") from None
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(path, f"peft_type {raw.get('peft_type')!r} is not LORA")
    if raw.get("use_dora"):
        raise _refuse(path, "DoRA (use_dora) is not supported")
    if raw.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {raw['modules_to_save']} is not supported (only LoRA deltas are)")
    if raw.get("bias", "none") != "none":
        raise _refuse(path, f"bias={raw['bias']!r} is not supported (only 'none')")
    if raw.get("fan_in_fan_out"):
        raise _refuse(path, "fan_in_fan_out is not supported")
    targets = raw.get("target_modules")
    if not targets:
        raise _refuse(path, "no target_modules")
    config = AdapterConfig(path, int(raw.get("r", 8)), float(raw.get("lora_alpha", 8)), bool(raw.get("use_rslora")),
                           targets if isinstance(targets, str) else sorted(targets),
                           {k: int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
                           {k: float(v) for k, v in (raw.get("alpha_pattern") or {}).items()})
    rank = max([config.r, *config.rank_pattern.values()])
    if rank > max_rank:
        raise _refuse(path, f"rank {rank} is above max_lora_rank={max_rank}")
    return config


def module_keys(targets: dict[str, tuple[int, int]], num_layers: int) -> list[str]:
    """The model's adaptable modules by their Hugging Face names (model.layers.{i}.self_attn.q_proj, ...)."""
    return [f"model.layers.{i}.{MODULE_PARENT[name]}.{name}" for i in range(num_layers) for name in targets]


def weight_file(path: str) -> Path:
    for name in WEIGHT_FILES:
        if (Path(path) / name).is_file():
            return Path(path) / name
    raise _refuse(path, f"no {' or '.join(WEIGHT_FILES)}")


def tensor_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes; a safetensors file is read from its header alone."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    return {name: tuple(t.shape) for name, t in state.items()}


def check(config: AdapterConfig, shapes: dict[str, tuple[int, ...]], targets: dict[str, tuple[int, int]],
          num_layers: int) -> None:
    """Refuse an adapter whose targets or tensors do not fit the served model (a module it lacks, another shape)."""
    path = config.path
    keys = module_keys(targets, num_layers)
    wanted = config.target_modules if isinstance(config.target_modules, list) else [config.target_modules]
    for target in wanted:
        probe = AdapterConfig(path, 1, 1.0, False, target if isinstance(config.target_modules, str) else [target])
        if not any(probe.targets(key) for key in keys):
            raise _refuse(path, f"target module {target!r} matches nothing this model can adapt "
                                f"({', '.join(targets) or 'none'})")
    for tensor, shape in shapes.items():
        m = TENSOR_NAME.fullmatch(tensor)
        if m is None or m["name"] not in targets:
            raise _refuse(path, f"tensor {tensor} is not a LoRA weight of a module this model can adapt")
        layer, name = int(m["layer"]), m["name"]
        if layer >= num_layers:
            raise _refuse(path, f"tensor {tensor} is for layer {layer}; the model has {num_layers}")
        rank, _ = config.rank_and_scale(m["module"])
        features_in, features_out = targets[name]
        expected = (rank, features_in) if m["part"] == "A" else (features_out, rank)
        if shape != expected:
            raise _refuse(path, f"tensor {tensor} has shape {list(shape)}, expected {list(expected)}: "
                                f"an adapter for another base model (or another rank)")


_IDENTITIES: dict[tuple, str] = {}  # (files, mtimes, sizes) -> digest: each file content is hashed once


def identity(path: str) -> str:
    """sha256 of the config and the weights, so the same name with new content is a new adapter."""
    files = [Path(path) / CONFIG_FILE, weight_file(path)]
    key = tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    if key not in _IDENTITIES:
        digest = hashlib.sha256()
        for f in files:
            with open(f, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
        _IDENTITIES[key] = digest.hexdigest()
    return _IDENTITIES[key]


def inspect(lora: LoRARequest, facts: LoRAFacts) -> ResolvedLoRA:
    """Everything checked at admission, reading tensor names and shapes only (never their values)."""
    if not isinstance(lora, LoRARequest):
        raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora).__name__}", "lora_request")
    path = os.path.abspath(lora.lora_path)
    config = read_config(path, facts.max_rank)
    check(config, tensor_shapes(weight_file(path)), facts.targets, facts.num_layers)
    return ResolvedLoRA(lora.lora_name, path, identity(path))


@dataclass
class LoadedAdapter:
    """An adapter's weights on the host: (layer, module name) -> (A^T [in, r], scale * B^T [r, out])."""
    identity: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load(lora: ResolvedLoRA, targets: dict[str, tuple[int, int]], num_layers: int, max_rank: int,
         dtype: torch.dtype) -> LoadedAdapter:
    """Read, check again (the folder may have changed since admission) and load the adapter's tensors."""
    config = read_config(lora.path, max_rank)
    file = weight_file(lora.path)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
    check(config, {k: tuple(v.shape) for k, v in state.items()}, targets, num_layers)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    scales: dict[tuple[int, str], float] = {}
    for tensor, value in state.items():
        m = TENSOR_NAME.fullmatch(tensor)
        key = (int(m["layer"]), m["name"])
        parts.setdefault(key, {})[m["part"]] = value
        scales[key] = config.rank_and_scale(m["module"])[1]
    weights = {}
    for key, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise _refuse(lora.path, f"layer {key[0]} {key[1]} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        weights[key] = (a.t().contiguous().to(dtype), (b.t() * scales[key]).contiguous().to(dtype))
    return LoadedAdapter(lora.identity, weights)
