"""Entry point of the engine-core child process: `python -m aserve.engine.core_child FD`."""
import os
import sys
from multiprocessing.connection import Connection

from aserve.engine.core_process import serve_core
from aserve.process_exit import exit_now


# The core keeps both cores busy; a slightly lower priority lets the front end's short bursts (a /health
# probe, an SSE write) preempt it at once instead of queueing behind its threads.
NICENESS = 5


def main() -> None:
    os.nice(NICENESS)
    conn = Connection(int(sys.argv[1]))
    try:
        serve_core(conn)
    finally:
        conn.close()
    exit_now(0)  # a core that died raised above: its traceback and status come the usual way


if __name__ == "__main__":
    main()
