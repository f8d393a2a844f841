"""Entry point of the engine-core child process: `python -m aserve.engine.core_child FD`."""
import sys
from multiprocessing.connection import Connection

from aserve.engine.core_process import serve_core


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    try:
        serve_core(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
