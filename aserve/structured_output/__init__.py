"""Structured output: constraints in vLLM's names (params), xgrammar behind them (grammar), the engine
core's compile thread, cache and matchers (manager), and the worker's one-call logits mask (bitmask)."""
from aserve.structured_output.params import KINDS, StructuredOutputsParams

__all__ = ["KINDS", "StructuredOutputsParams"]
