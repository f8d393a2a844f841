"""Multi-LoRA serving: adapters applied per token beside the base weights, never merged into them.

request (what a caller names), adapter (reading and checking a PEFT folder), cache (device slots and the host
cache of loaded adapters), layers (the batched shrink/expand each linear layer adds)."""
