"""`python -m load_tests SCENARIO [--url URL | --launch] [options]`: run one scenario, print its summary line,
write its JSON, exit 1 if it failed. Scenario options are given as --opt NAME=VALUE (see scenarios.py)."""
from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import socket
import subprocess
import sys
import time

import httpx

from load_tests.scenarios import SCENARIOS, SERVER_ARGS, Target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start `aserve` on 127.0.0.1 and a free port; return it once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "aserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *args])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited during start-up (status {proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not become healthy in time")


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests", description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (default %(default)s)")
    parser.add_argument("--launch", action="store_true",
                        help="start aserve on 127.0.0.1 with the scenario's recommended flags, and stop it after")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra flag for --launch (repeatable)")
    parser.add_argument("--api-key", default=os.environ.get("ASERVE_API_KEY"))
    parser.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                        help="a scenario option, e.g. num_requests=200 (repeatable)")
    parser.add_argument("--json", default=None, help="write the summary here (default: load_tests_SCENARIO.json)")
    args = parser.parse_args(argv)

    fn = SCENARIOS[args.scenario]
    options = dict(item.split("=", 1) for item in args.opt)
    known = set(inspect.signature(fn).parameters) - {"target"}
    if set(options) - known:
        parser.error(f"unknown option(s) {sorted(set(options) - known)}; {args.scenario} takes {sorted(known)}")
    options = {k: parse_value(v) for k, v in options.items()}

    proc = None
    url = args.url
    if args.launch:
        server_args = SERVER_ARGS.get(args.scenario, []) + [a for arg in args.server_arg for a in arg.split()]
        proc, url = launch(server_args)
    try:
        async def run():
            target = await Target(url, args.api_key).discover()
            return await fn(target, **options)
        summary = asyncio.run(run())
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(summary.line())
    summary.write(args.json or f"load_tests_{args.scenario}.json")
    return 0 if summary.passed else 1


if __name__ == "__main__":
    sys.exit(main())
