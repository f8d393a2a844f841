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

from aserve.engine.async_llm import AsyncLLM  # noqa: E402
from aserve.engine.core_process import EngineDeadError  # noqa: E402
from aserve.llm import LLM  # noqa: E402
from aserve.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from aserve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "AsyncLLM", "EngineDeadError", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
