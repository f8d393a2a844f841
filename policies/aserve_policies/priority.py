"""priority: lower `priority` value first, then arrival. The least urgent running request is preempted
when blocks run out, and also to admit a more urgent waiting request when the running set is full.

Options (`--policy-option`): `aging` = priority units a waiting request gains per second (default 0:
none), so nobody starves forever; `mode` = `recompute` (default) or `swap` for preempted requests.
"""
import time

from aserve.policy import KeyedQueue, Policy, PreemptionMode


class PriorityPolicy(Policy):
    name = "priority"
    description = "lower priority value first, then arrival; preempts the least urgent; optional aging"
    priority_classes = True

    def __init__(self, aging: float = 0.0, mode: str = "recompute"):
        self.aging = float(aging)
        self.mode = PreemptionMode(mode)

    def urgency(self, req) -> tuple:
        """Smaller is more urgent: (effective priority, arrival time)."""
        waited = time.monotonic() - req.arrival_time if self.aging else 0.0
        return req.priority - self.aging * waited, req.arrival_time

    def waiting_queue(self):
        return KeyedQueue(self.urgency)

    def select_victim(self, running, needing):
        return max(running, key=self.urgency) if running else None

    def preemption_mode(self, victim, kv_view):
        return self.mode

    def should_preempt_for(self, waiting, running):
        if not running:
            return None
        victim = max(running, key=self.urgency)
        return victim if self.urgency(victim) > self.urgency(waiting) else None
