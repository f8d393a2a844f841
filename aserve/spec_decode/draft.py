"""The engine's side of a draft model. The worker drafts at the end of each step, right after sampling, so that
its draft runs with the step's data at hand (worker.drafter); the engine hands those drafts out before the next
step, as the n-gram proposer hands out its lookups."""
from __future__ import annotations


class DraftProposals:
    def __init__(self) -> None:
        self.last: dict[str, list[int]] = {}

    def take(self, drafts: dict[str, list[int]]) -> None:
        """The drafts of the step that just ran (by request id): the only ones the next step may check."""
        self.last = drafts

    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """`requests`: (request id, its tokens, the most it may propose), as NgramProposer.propose takes them."""
        return {request_id: self.last[request_id][:most] for request_id, _, most in requests
                if request_id in self.last}
