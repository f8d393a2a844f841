"""PEFT adapters for the LoRA tests, and transformers + peft as their reference."""
from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(base: Path, out: Path, *, targets, r: int = 8, alpha: float = 16, seed: int = 0,
                 use_rslora: bool = False, rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
                 safetensors: bool = True) -> Path:
    """A PEFT LoRA adapter of the model in `base`, with random A and B (init_lora_weights=False: PEFT's default
    B = 0 would let a test pass with the adapter ignored), B scaled up so the adapter changes greedy tokens."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                             rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
                             init_lora_weights=False, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.mul_(20)
    adapted.save_pretrained(out, safe_serialization=safetensors)
    return out


def load_with_adapter(base: Path, adapter: Path | None):
    """transformers' model, with the adapter applied by peft (None: the base model alone)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        seq = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
                             eos_token_id=0)
    return seq[0, len(prompt):].tolist()


def last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
