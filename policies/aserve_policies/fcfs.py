"""fcfs: first come, first served; when blocks run out, the newest running request is recomputed later."""
from aserve.policy import Policy


class FCFSPolicy(Policy):
    name = "fcfs"
    description = "arrival order; preempts the most recently admitted request and recomputes it later"

    def select_victim(self, running, needing):
        return running[-1] if running else None
