"""Pooling models: one vector per prompt (an embedding, or the raw pooled hidden state) instead of generated text."""
