"""Speculative decoding: proposers guess a request's next tokens, and the target model checks them all in one pass.

`config` reads `speculative_config`; `ngram` proposes by prompt lookup; `draft` hands out what a draft model run
by the worker proposed (`worker.drafter`). The scheduler runs a request with proposals as 1 + k tokens
(`Request.spec_token_ids`), the worker samples every position (`worker.model_runner`) and keeps the proposals its
own samples agree with (rejection sampling against a draft model's distribution); see
docs/speculative-decoding.md.
"""
