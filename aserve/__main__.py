"""`python -m aserve ...` is the `aserve` command."""
from aserve.cli import run

if __name__ == "__main__":
    run()
