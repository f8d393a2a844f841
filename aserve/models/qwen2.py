"""Qwen2: the Llama block with a bias on the Q, K and V projections (none on the output projection)."""
from aserve.models.llama import LlamaForCausalLM, ModelArgs


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def args_from_config(cls, config: dict) -> ModelArgs:
        return ModelArgs.from_config(config, qkv_bias=True, o_bias=False)
