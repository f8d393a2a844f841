"""A scenario's summary: requests by outcome, output tokens/s, TTFT/ITL/E2E percentiles; printed and as JSON."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from load_tests.client import Result


def percentiles(values: list[float], points=(50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in points}
    ordered = sorted(values)
    out = {}
    for p in points:  # nearest-rank
        rank = max(1, -(-p * len(ordered) // 100))
        out[f"p{p}"] = ordered[rank - 1]
    return out


@dataclass
class Summary:
    scenario: str
    duration_s: float
    results: list[Result]
    checks: dict = field(default_factory=dict)  # what the scenario verified at the end (state, outputs...)
    extra: dict = field(default_factory=dict)

    @property
    def by_status(self) -> dict[str, int]:
        return dict(sorted(Counter(str(r.status) for r in self.results).items()))

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @property
    def server_errors(self) -> int:
        return sum(1 for r in self.results if (isinstance(r.status, int) and r.status >= 500 and
                                                r.status not in r.expected) or str(r.status).startswith("stream-error"))

    @property
    def passed(self) -> bool:
        return not self.failed and all(v is True or not isinstance(v, bool) for v in self.checks.values())

    def as_dict(self) -> dict:
        ok = [r for r in self.results if r.ok and r.e2e is not None and r.kind == "good"]
        tokens = sum(r.output_tokens for r in self.results if r.ok)
        return {
            "scenario": self.scenario, "duration_s": round(self.duration_s, 2), "requests": len(self.results),
            "ok": len(self.results) - len(self.failed), "failed": len(self.failed), "by_status": self.by_status,
            "failed_by_kind": dict(Counter(f"{r.kind}:{r.status}" for r in self.failed)),
            "server_errors": self.server_errors,
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / self.duration_s, 1) if self.duration_s else 0,
            "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
            "itl_s": percentiles([x for r in ok for x in r.itl]),
            "e2e_s": percentiles([r.e2e for r in ok]),
            "checks": self.checks, "passed": self.passed, **self.extra,
        }

    def line(self) -> str:
        d = self.as_dict()

        def fmt(p):
            return "/".join("-" if v is None else f"{v:.3f}" for v in p.values())
        return (f"{self.scenario}: {d['requests']} requests in {d['duration_s']} s, ok {d['ok']}, failed {d['failed']} "
                f"{d['by_status']} | {d['output_tokens_per_s']} out tok/s | TTFT p50/p90/p99 {fmt(d['ttft_s'])} s | "
                f"ITL {fmt(d['itl_s'])} s | E2E {fmt(d['e2e_s'])} s | checks "
                f"{'pass' if d['passed'] else 'FAIL ' + json.dumps(self.checks)}")

    def write(self, path: str | None) -> None:
        if path:
            with open(path, "w") as f:
                json.dump(self.as_dict(), f, indent=2)
