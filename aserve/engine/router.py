"""Which data-parallel replica gets a request: the rule alone, with no processes, so it is tested without a model.

The front end counts each replica's requests in flight (added and not yet finished, aborted or refused):
that is the replica's waiting + running + swapped requests, known without asking the core. A request goes
to the live replica with the fewest; ties rotate, so an idle server warms every replica. Prefix caching
pays only where a prompt's blocks already are, so a prompt whose first full block was routed before goes
back to that replica, unless it has more than `slack` requests above the least loaded one: balance first,
cache hits when they cost little.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

AFFINITY_SLACK = 2  # extra in-flight requests a replica may carry over the least loaded to keep a prefix hit
AFFINITY_ENTRIES = 16384  # first blocks remembered (LRU); a few MB at most


class Router:
    """Thread-safe: the event loop routes and aborts, each replica's reader thread finishes requests."""

    def __init__(self, num_replicas: int, block_size: int, slack: int = AFFINITY_SLACK):
        self.block_size = block_size
        self.slack = slack
        self.in_flight = [0] * num_replicas
        self.alive = [True] * num_replicas
        self._owner: dict[str, int] = {}  # request id -> replica
        self._affinity: OrderedDict[tuple[int, ...], int] = OrderedDict()  # first block -> replica
        self._turn = 0
        self._lock = threading.Lock()

    def _first_block(self, prompt_token_ids: list[int]) -> tuple[int, ...] | None:
        """The prompt's first full block, if it has one the cache can reuse (the last prompt token is always
        computed, so a prompt of exactly one block shares nothing); with one replica there is nothing to choose."""
        if len(self.alive) == 1 or len(prompt_token_ids) <= self.block_size:
            return None
        return tuple(prompt_token_ids[:self.block_size])

    def route(self, request_id: str, prompt_token_ids: list[int], exclude: int | None = None) -> int | None:
        """Pick a live replica (not `exclude`) and count the request on it; None when no replica is live."""
        key = self._first_block(prompt_token_ids)
        with self._lock:
            live = [i for i, up in enumerate(self.alive) if up and i != exclude]
            if not live:
                return None
            least = min(self.in_flight[i] for i in live)
            tied = [i for i in live if self.in_flight[i] == least]
            choice = tied[self._turn % len(tied)]
            self._turn += 1
            if key is not None:
                home = self._affinity.get(key)
                if home in live and self.in_flight[home] <= least + self.slack:
                    choice = home
                self._affinity[key] = choice
                self._affinity.move_to_end(key)
                if len(self._affinity) > AFFINITY_ENTRIES:
                    self._affinity.popitem(last=False)
            self._release_locked(request_id)
            self._owner[request_id] = choice
            self.in_flight[choice] += 1
            return choice

    def owner(self, request_id: str) -> int | None:
        with self._lock:
            return self._owner.get(request_id)

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted, refused); idempotent."""
        with self._lock:
            self._release_locked(request_id)

    def _release_locked(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            self.in_flight[replica] -= 1

    def mark_dead(self, replica: int) -> tuple[list[str], int]:
        """Take a replica out of routing; return the ids of the requests it held (now lost) and how many
        replicas are still live (counted under the same lock, so only one death sees zero)."""
        with self._lock:
            self.alive[replica] = False
            lost = [rid for rid, owner in self._owner.items() if owner == replica]
            for rid in lost:
                del self._owner[rid]
            self.in_flight[replica] = 0
            for key in [k for k, owner in self._affinity.items() if owner == replica]:
                del self._affinity[key]
            return lost, sum(self.alive)
