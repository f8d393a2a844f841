"""Ending a process once its work is done, without the interpreter's teardown.

With torch imported, CPython's teardown (a final garbage collection over torch's objects, its operator registry
taking itself apart) takes about a second on a 2-core VM, after everything that matters has finished: every
`aserve` command, engine core and tensor-parallel rank paid it on each exit, a server's stop twice over.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """Run the atexit handlers (logging's flush, temporary folders' clean-up), flush stdout and stderr, then end
    the process with `code` at once. Only for a process whose work is complete: other threads end with it."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, replaced or absent: nothing left to flush
            pass
    os._exit(code)


def exit_code(exc: SystemExit) -> int:
    """The status `raise SystemExit(x)` asks for, as the interpreter would give it (a message is printed, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1
