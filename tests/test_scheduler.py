"""The scheduler is the one authority on a request's end: stop strings, grammars, errors and aborts report a
reason to `Scheduler.finish`, which decides (a stop outranks a length end of the same step), and no other module
assigns a request's status. Runs without a model: the scheduler's decisions are plain data."""
from __future__ import annotations

import ast
from pathlib import Path

import aserve
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.scheduler import Scheduler
from aserve.policy import load_policy
from aserve.request import Request, RequestStatus
from aserve.sampling_params import SamplingParams

STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def scheduler() -> Scheduler:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    return Scheduler(kv, load_policy("fcfs"), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)


def request(request_id: str, max_tokens: int, **params) -> Request:
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, **params),
                   max_tokens=max_tokens)


def step(sched: Scheduler, token: int = 7) -> list[Request]:
    """One step in which every scheduled request that reaches its end samples `token`."""
    sched.schedule()
    return sched.update({req.request_id: token for req, _ in sched.scheduled})


def test_a_stop_found_on_the_token_that_ended_a_request_by_length_outranks_length():
    sched = scheduler()
    short, long = request("short", 1), request("long", 3)
    sched.add_request(short)
    sched.add_request(long)
    assert step(sched) == [short] and short.status == LENGTH
    ended_at = short.finished_time
    sched.finish(short, STOPPED, stop_reason="</s>")  # the stop string this very token completed
    assert (short.status, short.stop_reason, short.finished_time) == (STOPPED, "</s>", ended_at)
    assert sched.finished_since_stats == [short]  # ended once, counted once
    assert sched.kv.num_free_blocks < sched.kv.num_blocks  # "long" still holds its blocks


def test_a_request_ends_once_otherwise():
    sched = scheduler()
    first, second = request("first", 1), request("second", 2)
    sched.add_request(first)
    sched.add_request(second)
    step(sched)
    sched.finish(first, RequestStatus.FINISHED_ERROR, error="too late")  # an error does not rewrite an end
    sched.finish(first, RequestStatus.FINISHED_ABORTED)
    assert (first.status, first.error) == (LENGTH, None)
    assert step(sched) == [second]
    sched.finish(first, STOPPED, stop_reason="x")  # a stop reported a step later does not either
    assert (first.status, first.stop_reason) == (LENGTH, None)
    assert sched.finished_since_stats == [first, second]
    sched.kv.check_all_free()


def test_a_stop_string_names_the_reason_over_a_stop_token_of_the_same_step():
    sched = scheduler()
    req = request("r", 8, stop_token_ids=[7])
    sched.add_request(req)
    step(sched, token=7)
    assert (req.status, req.stop_reason) == (STOPPED, 7)
    sched.finish(req, STOPPED, stop_reason="stop")
    assert (req.status, req.stop_reason) == (STOPPED, "stop")
    waiting = request("w", 8)
    sched.add_request(waiting)  # an end decided outside update(): the reason comes with it
    sched.finish(waiting, RequestStatus.FINISHED_ERROR, error="its grammar failed to compile")
    assert (waiting.status, waiting.error, len(sched.waiting)) == (RequestStatus.FINISHED_ERROR,
                                                                   "its grammar failed to compile", 0)


def status_writers() -> list[str]:
    """Every assignment to a `.status` attribute in the package's modules that know requests (those that import
    aserve.request; an HTTP error's status is another matter), as 'path:line'."""
    root = Path(aserve.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        if "aserve.request " not in source and path.name != "request.py":
            continue
        for node in ast.walk(ast.parse(source, str(path))):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr == "status":
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_only_the_scheduler_sets_a_requests_status():
    writers = status_writers()
    assert writers and all(w.startswith(("core/scheduler.py:", "request.py:")) for w in writers), writers
    assert sum(w.startswith("request.py:") for w in writers) == 1  # the initial WAITING
