"""Speculative decoding: proposers guess a request's next tokens, and the target model checks them all in one pass.

`config` reads `speculative_config`; `ngram` proposes by prompt lookup. The scheduler runs a request with
proposals as 1 + k tokens (`Request.spec_token_ids`), the worker samples every position (`worker.model_runner`)
and keeps the proposals its own samples agree with; see docs/speculative-decoding.md.
"""
