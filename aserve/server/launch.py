"""Start the server: load the engine, build the app, run uvicorn; on SIGINT/SIGTERM drain and exit 0."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

log = logging.getLogger("aserve")
DEATH_GRACE_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face folder (default: the embedded model)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("ASERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on the API routes (or set ASERVE_API_KEY)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="4GiB", help="KV cache budget: bytes or e.g. 2GiB")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--policy", default="fcfs", help="scheduling policy: an installed name, module:Class or "
                                                         "path/to/file.py:Class")
    parser.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option for the policy's constructor, e.g. aging=0.5 (repeatable)")
    parser.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out KV blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-request-body", type=int, default=8 * 1024 * 1024, help="bytes; larger bodies get 413")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish after SIGINT/SIGTERM")
    parser.add_argument("--root-path", default="", help="the path prefix a reverse proxy serves us under")
    limits = parser.add_argument_group("overload protection and limits")
    limits.add_argument("--max-waiting-requests", type=int, default=None,
                        help="refuse new requests with 503 + Retry-After while this many are waiting (default: no "
                             "bound)")
    limits.add_argument("--request-timeout", type=float, default=None,
                        help="abort a generation that runs longer than this many seconds (504; default: none)")
    limits.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a client may take to send its request body (408)")
    limits.add_argument("--max-n", type=int, default=32, help="the largest n (samples per prompt) a request may ask")
    security = parser.add_argument_group("security")
    security.add_argument("--log-requests", action="store_true",
                          help="log prompts and completions (off by default: no request text reaches the logs)")
    security.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                          help="enable CORS for these origins ('*' for any); off by default")


def parse_options(items: list[str]) -> dict:
    """KEY=VALUE strings to a dict; values that read as numbers become numbers."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--policy-option wants KEY=VALUE, got {item!r}")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        options[key] = value
    return options


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from aserve.engine.async_llm import AsyncLLM
    from aserve.server.app import build_app

    engine = AsyncLLM(args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
                      policy=args.policy, policy_options=parse_options(args.policy_option), swap_space=args.swap_space,
                      seed=args.seed, served_model_name=args.served_model_name, max_n=args.max_n,
                      max_waiting_requests=args.max_waiting_requests)
    app = build_app(engine, args.served_model_name, args.api_key, args.max_request_body, args.root_path,
                    body_timeout=args.body_timeout, request_timeout=args.request_timeout,
                    log_requests=args.log_requests, allowed_origins=args.allowed_origins)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout, access_log=False, root_path=args.root_path)
    server = uvicorn.Server(config)

    def engine_died(exc: BaseException) -> None:
        # /health answers 503 for a moment (so probes see why), then the process exits non-zero for a supervisor
        log.error("the engine core died (%s): exiting in %.0f s", exc, DEATH_GRACE_S)
        asyncio.get_running_loop().call_later(DEATH_GRACE_S, setattr, server, "should_exit", True)

    engine.on_death.append(engine_died)
    log.info("serving %s on http://%s:%d (API key %s)", engine.config.model, args.host, args.port,
             "required" if args.api_key else "not required")
    # uvicorn drains, then re-raises the signal it caught: make that an orderly exit with status 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_cleanly)
    server.run()
    sys.exit(1 if engine.dead_error is not None else 0)
