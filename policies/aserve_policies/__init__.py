"""aserve's built-in scheduling policies, shipped as a plugin distribution of their own."""
