"""aserve: an asyncio-native LLM serving engine with a paged KV cache and pluggable scheduling policies."""
from aserve.llm import LLM
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
