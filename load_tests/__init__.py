"""Load, soak and fault scenarios against a running aserve (or any OpenAI-compatible server).

`python -m load_tests SCENARIO --url http://127.0.0.1:8000` runs one; see load_tests/README.md.
"""
