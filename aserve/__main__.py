"""`python -m aserve ...` is the `aserve` command."""
from aserve.cli import main

if __name__ == "__main__":
    main()
