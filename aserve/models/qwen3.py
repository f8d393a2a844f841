"""Qwen3: the Llama block with RMSNorm on each head's queries and keys before the rotary embedding."""
from aserve.models.llama import LlamaForCausalLM, ModelArgs


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def args_from_config(cls, config: dict) -> ModelArgs:
        return ModelArgs.from_config(config, qk_norm=True)
