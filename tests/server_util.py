"""Start `aserve` as a subprocess on 127.0.0.1 and a free port; stop it afterwards, always."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, *args: str, startup_timeout: float = 60.0, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="aserve-test-server-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "aserve.cli", "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def stop(self, sig: int | None = None, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        """Everything the server has logged so far (stdout and stderr)."""
        with open(self.log.name) as f:
            return f.read()

    def core_pid(self) -> int:
        """The engine core's process: the server's only child."""
        children = [int(pid) for task in os.listdir(f"/proc/{self.proc.pid}/task")
                    for pid in open(f"/proc/{self.proc.pid}/task/{task}/children").read().split()]
        assert len(children) == 1, children
        return children[0]

    @contextlib.contextmanager
    def core_stopped(self):
        """Freeze the engine core (SIGSTOP) for the block: requests queue and none can finish, on any CPU."""
        pid = self.core_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)
