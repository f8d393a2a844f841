"""Start the server: load the engine, build the app, run uvicorn; on SIGINT/SIGTERM drain and exit 0."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aserve.config import EngineConfig, add_engine_arguments, engine_options
from aserve.engine.core_process import start_early

log = logging.getLogger("aserve")
DEATH_GRACE_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags; the engine's come from EngineConfig (see aserve.config.add_engine_arguments)."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get("ASERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on the API routes (or set ASERVE_API_KEY)")
    parser.add_argument("--max-request-body", type=int, default=8 * 1024 * 1024, help="bytes; larger bodies get 413")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish after SIGINT/SIGTERM")
    parser.add_argument("--root-path", default="", help="the path prefix a reverse proxy serves us under")
    parser.add_argument("--no-ui", dest="ui", action="store_false",
                        help="do not serve the playground page at / (GET / then answers 404)")
    parser.add_argument("--tool-call-parser", default="hermes",
                        help="how tool calls are found in the output of tool_choice 'auto': an installed parser "
                             "(entry-point group aserve.tool_parsers; built in: hermes), module:Class or "
                             "path/to/file.py:Class; 'none' turns auto tool choice off (default: hermes)")
    limits = parser.add_argument_group("overload protection and limits")
    limits.add_argument("--request-timeout", type=float, default=None,
                        help="abort a generation that runs longer than this many seconds (504; default: none)")
    limits.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a client may take to send its request body (408)")
    security = parser.add_argument_group("security")
    security.add_argument("--log-requests", action="store_true",
                          help="log prompts and completions (off by default: no request text reaches the logs)")
    security.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                          help="enable CORS for these origins ('*' for any); off by default")
    lora = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="PEFT adapters to serve, each picked by a request's \"model\": name=path, or JSON "
                           "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    lora.add_argument("--allow-runtime-lora-updates", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (else they answer 404)")
    add_engine_arguments(parser)


def lora_modules(args: argparse.Namespace, options: dict) -> list:
    """The --lora-modules entries, parsed before anything loads (a malformed one is a one-line error)."""
    from aserve.lora.registry import parse_module

    modules = [parse_module(spec) for spec in args.lora_modules]
    if (modules or args.allow_runtime_lora_updates) and not options.get("enable_lora"):
        raise ValueError("--lora-modules and --allow-runtime-lora-updates need --enable-lora")
    return modules


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def serve(args: argparse.Namespace) -> None:
    options = engine_options(args)
    config = EngineConfig.from_kwargs(**options)
    config.verify()  # before torch, uvicorn or the core: a wrong flag fails at once
    if config.data_parallel_backend != "ray":  # a Ray replica's core starts as an actor
        start_early(config.data_parallel_size)  # the cores import torch while this process imports the server
    adapters = lora_modules(args, options)
    tool_call_parser = None if args.tool_call_parser == "none" else args.tool_call_parser
    if tool_call_parser is not None:
        from aserve.tool_parsers import load_tool_parser

        tool_call_parser = load_tool_parser(tool_call_parser)

    import uvicorn

    from aserve.engine.async_llm import AsyncLLM
    from aserve.server.app import build_app

    engine = AsyncLLM(**options)
    try:
        app = build_app(engine, args.served_model_name, args.api_key, args.max_request_body, args.root_path,
                        body_timeout=args.body_timeout, request_timeout=args.request_timeout,
                        log_requests=args.log_requests, allowed_origins=args.allowed_origins,
                        tool_call_parser=tool_call_parser, ui=args.ui, lora_modules=adapters,
                        allow_runtime_lora_updates=args.allow_runtime_lora_updates)
    except BaseException:  # an adapter the model cannot serve: stop the core before the one-line error
        asyncio.run(engine.shutdown())
        raise
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
