"""shortest-prompt-first: admit the waiting request with the fewest prompt tokens first.

Short prompts need little prefill, so serving them first cuts the mean time to first token when long
and short prompts queue together (the scheduling analogue of shortest-job-first). When blocks run out,
the running request with the most tokens in the cache is preempted: it frees the most memory.
"""
from aserve.policy import KeyedQueue, Policy, PreemptionMode


class ShortestPromptFirst(Policy):
    name = "shortest-prompt-first"
    description = "admits the shortest waiting prompt first; preempts the request holding the most tokens"

    def waiting_queue(self):
        return KeyedQueue(lambda req: (req.num_prompt_tokens, req.arrival_time))

    def select_victim(self, running, needing):
        return max(running, key=lambda req: (req.num_computed_tokens, req.arrival_time)) if running else None

    def preemption_mode(self, victim, kv_view):
        return PreemptionMode.RECOMPUTE
