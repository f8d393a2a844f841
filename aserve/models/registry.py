"""Which class serves which `architectures` entry of config.json, imported only when a model needs it.

A family is one module; adding one is a line here. `check_model_dir` answers "can this folder be served?"
from config.json alone, so a front end can refuse a wrong folder before loading any weights.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

# architectures name -> (module under aserve.models, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
}
# The bare decoder stacks (no LM head), as sentence-transformers saves an embedder: served by the pooling runner
# alone, as the same classes with the embedding standing in for the head they lack.
BARE_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                      "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
ARCHITECTURES.update({bare: ARCHITECTURES[full] for bare, full in BARE_ARCHITECTURES.items()})
# Decoder classifiers and rerankers: the same classes again, with a `score` projection of the last token's state
# onto the labels in place of the LM head (the loader adds it).
DECODER_CLASSIFIERS = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                       "MistralForSequenceClassification": "MistralForCausalLM",
                       "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                       "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
ARCHITECTURES.update({arch: ARCHITECTURES[full] for arch, full in DECODER_CLASSIFIERS.items()})
# Encoders (aserve.models.bert): embedders, the masked-LM checkpoints among them, and classifiers.
ENCODERS = {"BertModel": "BertModel", "BertForMaskedLM": "BertModel",
            "BertForSequenceClassification": "BertForSequenceClassification",
            "RobertaModel": "RobertaModel", "RobertaForMaskedLM": "RobertaModel",
            "RobertaForSequenceClassification": "RobertaForSequenceClassification",
            "XLMRobertaModel": "RobertaModel", "XLMRobertaForMaskedLM": "RobertaModel",
            "XLMRobertaForSequenceClassification": "RobertaForSequenceClassification"}
ARCHITECTURES.update({arch: ("bert", cls) for arch, cls in ENCODERS.items()})
# What the pooling runner alone can serve: nothing here has an LM head to generate with.
POOLING_ONLY = frozenset(BARE_ARCHITECTURES) | frozenset(DECODER_CLASSIFIERS) | frozenset(ENCODERS)


def is_classifier(arch: str) -> bool:
    """A `*ForSequenceClassification` model: it pools into its labels' logits (classify, score, rerank)."""
    return arch.endswith("ForSequenceClassification")


def supported() -> list[str]:
    return sorted(ARCHITECTURES)


def read_config(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist")
    return read_json(model_dir / "config.json")


def read_json(path: Path) -> dict:
    """A JSON file of the model folder; a missing or broken one is named."""
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found in {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def architecture(config: dict) -> str:
    """The first of config.json's `architectures` that aserve serves; a ValueError listing them otherwise."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"config.json: architectures {archs} not supported; supported: {', '.join(supported())}")
    return arch


def check_model_dir(model_dir: str | Path) -> str:
    """The architecture a folder would be served as, checked without importing torch models or reading weights."""
    return architecture(read_config(model_dir))


def model_class(arch: str) -> type:
    module, name = ARCHITECTURES[arch]
    return getattr(importlib.import_module(f"aserve.models.{module}"), name)
