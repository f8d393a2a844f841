"""Phi-3: the Llama block with Q/K/V and gate/up already fused in the checkpoint (`qkv_proj`,
`gate_up_proj`, the layout our Llama uses), an optional partial rotary factor and sliding window."""
from aserve.models.llama import LlamaForCausalLM, ModelArgs


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def args_from_config(cls, config: dict) -> ModelArgs:
        return ModelArgs.from_config(config, sliding_window=config.get("sliding_window"))
