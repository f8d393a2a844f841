"""Mistral: the Llama block, with sliding-window attention when the config sets `sliding_window`."""
from aserve.models.llama import LlamaForCausalLM, ModelArgs


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def args_from_config(cls, config: dict) -> ModelArgs:
        return ModelArgs.from_config(config, sliding_window=config.get("sliding_window"))
