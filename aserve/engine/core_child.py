"""Entry point of the engine-core child process: `python -m aserve.engine.core_child FD`."""
import os
import sys
from multiprocessing.connection import Connection

from aserve.engine.core_process import serve_core


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


if __name__ == "__main__":
    main()
