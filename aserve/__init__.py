"""aserve: an asyncio-native LLM serving engine with a paged KV cache and pluggable scheduling policies."""
import logging
import os

if os.environ.get("ASERVE_CONFIGURE_LOGGING", "1") != "0" and not logging.getLogger("aserve").handlers:
    # Like vLLM: start-up facts (KV blocks, concurrency) are shown unless the application configures logging.
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
    logging.getLogger("aserve").addHandler(_handler)
    logging.getLogger("aserve").setLevel(logging.INFO)
    logging.getLogger("aserve").propagate = False

# The public names load on first use, so `aserve --policy nope` can refuse a flag before torch is imported.
_EXPORTS = {"AsyncLLM": "aserve.engine.async_llm", "EngineDeadError": "aserve.errors", "LLM": "aserve.llm",
            "CompletionOutput": "aserve.outputs", "Logprob": "aserve.outputs", "RequestOutput": "aserve.outputs",
            "SamplingParams": "aserve.sampling_params", "LoRARequest": "aserve.lora.request",
            "PoolingParams": "aserve.pooling.params", "PoolingRequestOutput": "aserve.outputs",
            "EmbeddingRequestOutput": "aserve.outputs", "ClassificationRequestOutput": "aserve.outputs",
            "ScoringRequestOutput": "aserve.outputs", "BeamSearchParams": "aserve.sampling_params",
            "BeamSearchOutput": "aserve.outputs", "BeamSearchSequence": "aserve.outputs"}

__all__ = ["LLM", "AsyncLLM", "EngineDeadError", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "LoRARequest", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
