"""Randomized soak runs that hunt for the bugs fixed tests miss. Not part of CI: they take minutes and pick their
cases at random (reproducible from --seed).

  python tools/soak.py engine --seed 7 --rounds 40
      Random engine configurations (KV cache of 1-64 MiB, block size, multi-step, token budget, prefix caching,
      policy and its preemption mode, swap pool, n-gram speculation) run random batches of greedy and seeded requests (n, top-k/p, min-p,
      penalties, logit bias, logprobs, stop tokens, shared prefixes, some constrained by a regex, a choice or a JSON
      schema) and beam searches on the embedded default model
      in fp32 (--family: one of the test suite's tiny models of another family; --lora N: each request runs one of N
      random LoRA adapters or the base model, with 1 to N adapters a step; --pipeline: half the rounds on two
      pipeline stages; --chaos: half the rounds under a policy plugin that picks victims and modes at random). Every request must give the tokens it
      gives alone in a roomy engine, and its logprobs within 1e-3 (not bit-exact after a preemption by recompute,
      which computes its output tokens again as part of a prompt). So a seeded draw that falls within that rounding
      of the line between two tokens can differ too (docs/offline.md); a sampler bug shows as more, or as greedy
      ones.
      Seeded requests under speculation are not compared: their draws follow the proposals a step checks, which a
      tight cache or a preemption cuts (docs/speculative-decoding.md).
  python tools/soak.py server --seed 3 --policy priority --num-scheduler-steps 8 [-- --swap-space 0 ...]
      A local server (127.0.0.1, a free port, a 2 MiB cache) gets waves of concurrent completions, chats, /generate
      streams and beam searches, some cancelled mid-stream, some constrained (JSON object or schema, regex, choice).
      No request may get a 5xx or hang, a constrained one that stops must end inside its constraint, and once the
      waves end /health is 200 and every request and KV gauge on /metrics is back to 0. --lora N: requests name
      one of N random LoRA adapters, which are loaded and unloaded while they run (a 404 for one unloaded is fine).

Found so far: seeded requests drawing differently beside top-k/top-p/min-p ones (92cd0fa), a beam search that
could never come back from recompute waiting forever with the cache empty (93ebf3f), a seeded draw flipping where a
prompt's short tail ran through the decode kernel (2afdb2c), a request swapped in and out again in one step,
resuming with another K/V (43cb37b; with --lora, as it happened), and a recomputed beam search whose second beam's
prefix-cache hit was handed to the first beam as a new block (c3c508f).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# (request fields, a check of the text a request that stopped on its own ended with)
CONSTRAINTS = [
    ({"response_format": {"type": "json_object"}}, _json_object),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}}},
     lambda text: _json_object(text) and set(json.loads(text)) == {"name", "age"}),
    ({"guided_regex": "[A-Z]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[A-Z]{3}-[0-9]{2}", text) is not None),
    ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
]
def random_structure(rng: random.Random):
    """A constraint for a request of the engine soak: a regex, a choice, a JSON schema or any JSON object."""
    from aserve.structured_output import StructuredOutputsParams

    return rng.choice([
        lambda: StructuredOutputsParams(regex="[A-Z]{3}-[0-9]{2}( [a-z]+)?"),
        lambda: StructuredOutputsParams(choice=["yes", "no", "maybe later"]),
        lambda: StructuredOutputsParams(json={"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}}, "required": ["name", "n"]}),
        lambda: StructuredOutputsParams(json_object=True),
    ])()


SEEDED_OPTIONS = [{}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 50, "top_p": 0.8}]
EXTRA_OPTIONS = [{}, {}, {"logprobs": 2}, {"presence_penalty": 0.5, "frequency_penalty": 0.3},
                 {"repetition_penalty": 1.2}]


def random_params(rng: random.Random, max_tokens: int, vocab: int):
    from aserve import BeamSearchParams, SamplingParams

    if rng.random() < 0.12:
        return BeamSearchParams(rng.choice([2, 2, 3, 4]), max_tokens, ignore_eos=rng.random() < 0.7,
                                length_penalty=rng.choice([1.0, 0.5, 2.0]),
                                structured_outputs=random_structure(rng) if rng.random() < 0.2 else None)
    options = {"max_tokens": max_tokens, "ignore_eos": True,
               "stop_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(0, 3))]}
    if rng.random() < 0.5:
        options |= {"temperature": rng.choice([0.5, 0.9, 1.0, 1.3]), "seed": rng.randrange(1 << 30),
                    "n": rng.choice([1, 1, 2, 3])} | rng.choice(SEEDED_OPTIONS)
    else:
        options["temperature"] = 0
    options |= rng.choice(EXTRA_OPTIONS + [{"logit_bias": {rng.randrange(1, vocab): 5.0}}])
    if rng.random() < 0.15:
        options["structured_outputs"] = random_structure(rng)
    return SamplingParams(**options)


def chaos_policy(seed: int):
    """A policy plugin that decides at random: any running request as the victim (the one needing blocks too),
    swap or recompute, and now and then a running request displaced for a waiting one that does not fit. The
    scheduler's mechanism must keep every request's tokens whatever a policy decides."""
    from aserve.policy import Policy, PreemptionMode

    class Chaos(Policy):
        name = "chaos"

        def __init__(self):
            self.rng = random.Random(seed)

        def __repr__(self) -> str:
            return f"chaos(seed={seed})"

        def select_victim(self, running, needing):
            return self.rng.choice(list(running) + [needing])

        def preemption_mode(self, victim, kv_view):
            return self.rng.choice([PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])

        def should_preempt_for(self, waiting, running):
            return self.rng.choice(list(running)) if running and self.rng.random() < 0.2 else None

    return Chaos()


def random_config(rng: random.Random, kv_sizes: list) -> dict:
    config = dict(dtype="float32", disable_log_stats=True, kv_cache_memory=rng.choice(kv_sizes),
                  block_size=rng.choice([8, 16, 32]), num_scheduler_steps=rng.choice([1, 1, 2, 4, 8]),
                  max_num_seqs=rng.choice([2, 4, 8, 64]), max_num_batched_tokens=rng.choice([64, 128, 512, 2048]),
                  enable_prefix_caching=rng.random() < 0.7, policy=rng.choice(["fcfs", "fcfs-swap", "priority"]),
                  swap_space=rng.choice([0, 0.25]))
    if config["policy"] == "priority" and config["swap_space"] and rng.random() < 0.5:
        config["policy_options"] = {"mode": "swap"}
    if config["num_scheduler_steps"] == 1 and rng.random() < 0.3:
        config["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.choice([2, 4]),
                                        "prompt_lookup_max": 3}
    return config


def random_prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    shared = [rng.randrange(1, vocab) for _ in range(rng.randrange(5, 60))]
    prompts = []
    for _ in range(rng.randrange(3, 24)):
        own = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 90))]
        prompts.append(shared + own if rng.random() < 0.4 else own)
    return prompts


def make_adapters(model: Path, count: int) -> list:
    """`count` PEFT LoRA adapters of the model, with random weights strong enough to change its tokens (ranks 4 to 16,
    on attention only, on the MLP only, or on every projection), as the LoRA tests make them."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from lora_helpers import make_adapter

    from aserve.lora.request import LoRARequest

    kinds = [(["q_proj", "v_proj"], 8), (["gate_proj", "up_proj", "down_proj"], 4),
             (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16)]
    root = Path(tempfile.mkdtemp(prefix="soak-lora-"))
    made = []
    for i in range(count):
        targets, rank = kinds[i % len(kinds)]
        path = make_adapter(model, root / f"a{i}", targets=targets, r=rank, alpha=2 * rank, seed=i)
        made.append(LoRARequest(f"a{i}", i + 1, str(path)))
    return made


def run_batch(engine, prompts, params, priority, loras) -> list:
    """Every request queued at once (sampled ones and beam searches alike), then stepped to the end: the final
    outputs in order, None for a request the engine refused (too large for this round's cache, too wide)."""
    from aserve.errors import InvalidRequestError

    ids = []
    for i, (prompt, p, urgency, lora) in enumerate(zip(prompts, params, priority, loras)):
        try:
            ids.append(engine.add_request(prompt, p, request_id=f"q{i}", priority=urgency, lora_request=lora))
        except InvalidRequestError:
            ids.append(None)
    done = {}
    while engine.has_unfinished():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    return [done.get(request_id) for request_id in ids]


def soak_engine(args) -> int:
    import tempfile

    from aserve import LLM
    from aserve.config import DEFAULT_MODEL_DIR

    rng, model, kv_sizes = random.Random(args.seed), str(DEFAULT_MODEL_DIR), ["1MiB", "2MiB", "4MiB", "64MiB"]
    if args.family:  # one of the test suite's tiny random models (tests/conftest.py), caches sized in its blocks
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from conftest import build_tiny_model, kv_memory_for_blocks

        path = build_tiny_model(Path(tempfile.mkdtemp(prefix="soak-")), args.family)
        model, kv_sizes = str(path), [kv_memory_for_blocks(path, n) for n in (8, 16, 32, 512)]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    adapters = make_adapters(Path(model), args.lora) if args.lora else []
    lora_options = {}
    if adapters:
        lora_options = dict(enable_lora=True, max_lora_rank=16, max_loras=1, max_cpu_loras=len(adapters))
    reference = LLM(model, dtype="float32", kv_cache_memory="256MiB", disable_log_stats=True, **lora_options)

    def alone(prompt, params, lora):
        return run_batch(reference.engine, [prompt], [params], [0], [lora])[0].outputs

    from aserve import SamplingParams

    probe = (list(range(1, 30)), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    base = alone(*probe, None)[0].token_ids
    for lora in adapters:  # else the soak would compare the base model with itself
        assert alone(*probe, lora)[0].token_ids != base, f"adapter {lora.lora_name} does not change the tokens"

    failures = 0
    for round_ in range(args.rounds):
        config, prompts = random_config(rng, kv_sizes), random_prompts(rng, vocab)
        params = [random_params(rng, rng.randrange(1, 40), vocab) for _ in prompts]
        priority = [rng.randrange(0, 3) for _ in prompts] if config["policy"] == "priority" else None
        loras = [rng.choice(adapters + [None]) for _ in prompts] if adapters else [None] * len(prompts)
        if args.chaos and rng.random() < 0.5:
            config["policy"] = chaos_policy(rng.randrange(1 << 30))
            config.pop("policy_options", None)
            priority = None
        if args.pipeline and rng.random() < 0.5:  # two stages, up to two batches in flight (one step each, no
            config |= dict(pipeline_parallel_size=2, num_scheduler_steps=1)  # speculation)
            config.pop("speculative_config", None)
        if adapters:  # how many adapters a step may hold, and how many stay loaded, varies by round
            config |= dict(enable_lora=True, max_lora_rank=16, max_loras=(slots := rng.randint(1, len(adapters))),
                           max_cpu_loras=rng.randint(slots, len(adapters)))
        llm = LLM(model, **config)
        outputs = run_batch(llm.engine, prompts, params, priority or [0] * len(prompts), loras)
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            if out is None:  # refused up front, as it should be
                continue
            if config.get("speculative_config") and getattr(params[i], "temperature", 0) > 0:
                continue  # its draws follow the proposals it checks, which a tight cache or a preemption cuts
            want = alone(prompt, params[i], loras[i])
            got_tokens, want_tokens = [c.token_ids for c in out.outputs], [c.token_ids for c in want]
            drift = max((abs(a.cumulative_logprob - b.cumulative_logprob) for a, b in zip(out.outputs, want)
                         if a.cumulative_logprob is not None and b.cumulative_logprob is not None), default=0.0)
            if got_tokens != want_tokens or drift > 1e-3:
                failures += 1
                print(f"round {round_} request {i}: {params[i]}, adapter {loras[i] and loras[i].lora_name}\n"
                      f"  config {config}\n  prompt {len(prompt)} tokens,"
                      f" logprob drift {drift:.2e}\n  got  {got_tokens}\n  alone {want_tokens}", flush=True)
        llm.engine.executor.shutdown()
        beams = sum(hasattr(p, "beam_width") for p in params)
        constrained = sum(p.structured_outputs is not None for p in params)
        refused = outputs.count(None)
        print(f"round {round_}: {len(prompts)} requests ({beams} beam searches, {constrained} constrained, "
              f"{refused} refused), {config}", flush=True)
    print(f"{failures} requests differ from alone")
    return 1 if failures else 0


async def soak_server(args) -> int:
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from server_util import RunningServer

    rng = random.Random(args.seed)
    lora_args, names = [], []
    if args.lora:  # the first adapter from the start, the others loaded and unloaded while the waves run
        from aserve.config import DEFAULT_MODEL_DIR

        adapters = make_adapters(Path(DEFAULT_MODEL_DIR), args.lora)
        names = [lora.lora_name for lora in adapters]
        lora_args = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", str(rng.randint(1, args.lora)),
                     "--allow-runtime-lora-updates", "--lora-modules", f"{names[0]}={adapters[0].lora_path}"]
    server = RunningServer("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "2MiB",
                           "--max-n", "4", "--policy", args.policy, "--num-scheduler-steps",
                           str(args.num_scheduler_steps), *lora_args, *args.server_args)
    problems: list[str] = []
    checked: list[str] = []  # constrained answers whose text was checked
    words = ["the", "cat", "sat", "on", "a", "mat", "hello", "world"]

    async def one(client: httpx.AsyncClient) -> str | int:
        kind = rng.choice(["completion", "completion stream", "chat", "chat stream", "generate", "beams"])
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 200)))
        body: dict = {"max_tokens": rng.randrange(1, 60)}
        if rng.random() < 0.5:
            body |= {"temperature": rng.choice([0.0, 0.7, 1.2]), "seed": rng.randrange(1000)}
        if rng.random() < 0.3:
            body |= {"top_k": 10, "top_p": 0.9}
        if rng.random() < 0.3:
            body["n"] = rng.randrange(1, 4)
        if rng.random() < 0.2:
            body |= {"logprobs": True, "top_logprobs": 2} if kind.startswith("chat") else {"logprobs": 2}
        if rng.random() < 0.2:
            body["stop"] = ["the", "\n"]
        constraint = rng.choice(CONSTRAINTS) if rng.random() < 0.2 and kind != "generate" else None
        if constraint is not None:
            body |= constraint[0]
        if names and kind != "generate" and rng.random() < 0.6:  # an adapter that may be unloaded by now: 404
            body["model"] = rng.choice(names)
        if kind.startswith("chat"):
            url, body = "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}]}
        elif kind == "generate":
            url, body = "/generate", {"prompt": text, "max_tokens": body["max_tokens"], "stream": True}
        elif kind == "beams":
            url, body = "/v1/completions", {"prompt": text, "max_tokens": body["max_tokens"], "use_beam_search": True,
                                            "n": 2, "best_of": 2, "temperature": 0} | (
                {"model": body["model"]} if "model" in body else {})
        else:
            url, body = "/v1/completions", body | {"prompt": text}
        if kind.endswith("stream"):
            body["stream"] = True
        cancel_after = rng.uniform(0.01, 1.0) if rng.random() < 0.3 else None
        try:
            async with client.stream("POST", server.url + url, json=body, timeout=args.timeout) as response:
                start, chunks = time.monotonic(), []
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)
                    if cancel_after is not None and time.monotonic() - start > cancel_after:
                        return "cancelled"
                content = b"".join(chunks)
                if response.status_code >= 500:
                    problems.append(f"{kind} got {response.status_code}: {content[:300]!r}")
                elif response.status_code == 200 and constraint is not None and not body.get("stream") \
                        and not body.get("stop"):  # a stop string ends the text where it occurs, inside or not
                    checked.append(kind)
                    for choice in json.loads(content)["choices"]:
                        text = choice["message"]["content"] if "message" in choice else choice["text"]
                        if choice["finish_reason"] == "stop" and not constraint[1](text):
                            problems.append(f"{kind} {constraint[0]} ended with {text!r}, outside its constraint")
                return response.status_code
        except httpx.HTTPError as exc:
            problems.append(f"{kind} {({k: v for k, v in body.items() if k not in ('prompt', 'messages')})}: "
                            f"{exc!r} (a request that hangs ends as a read timeout)")
            return "failed"

    loaded = set(names[:1])

    async def churn(client: httpx.AsyncClient) -> None:
        """Load and unload the adapters while requests run under them (those running finish with theirs)."""
        while True:
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            name = rng.choice(names)
            route = "unload" if name in loaded else "load"
            body = {"lora_name": name}
            if route == "load":
                body["lora_path"] = adapters[names.index(name)].lora_path
            response = await client.post(f"{server.url}/v1/{route}_lora_adapter", json=body, timeout=args.timeout)
            if response.status_code != 200:
                problems.append(f"{route} {name} got {response.status_code}: {response.text[:300]}")
            loaded.symmetric_difference_update({name})
            statuses[f"{route}ed"] += 1

    statuses: Counter = Counter()
    try:
        async with httpx.AsyncClient() as client:
            for wave in range(args.waves):
                started, count = time.monotonic(), rng.randrange(5, 40)
                churning = asyncio.ensure_future(churn(client)) if names else None
                statuses.update(await asyncio.gather(*[one(client) for _ in range(count)]))
                if churning is not None:
                    churning.cancel()
                    await asyncio.gather(churning, return_exceptions=True)
                print(f"wave {wave}: {count} requests in {time.monotonic() - started:.1f} s", flush=True)
            await asyncio.sleep(2)
            health = (await client.get(server.url + "/health")).status_code
            metrics = (await client.get(server.url + "/metrics")).text
    finally:
        server.stop()
    busy = [line for line in metrics.splitlines()
            if line.startswith(("aserve:num_requests_", "aserve:kv_cache_usage_perc", "aserve:cpu_cache_usage_perc"))
            and float(line.rsplit(" ", 1)[1]) != 0.0]
    print(f"statuses {dict(statuses)}, /health {health}, {len(checked)} constrained answers checked")
    for problem in problems + [f"not idle: {line}" for line in busy] + ([f"/health {health}"] if health != 200 else []):
        print(problem)
    return 1 if problems or busy or health != 200 else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    engine = sub.add_parser("engine", help="random configurations and batches against each request alone")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--rounds", type=int, default=20)
    engine.add_argument("--family", help="a tiny random model of this family from tests/conftest.py (llama-untied, "
                                         "qwen3, mistral-swa, opt, gpt2, phi3, gemma2, ...), not the default model")
    engine.add_argument("--chaos", action="store_true",
                        help="half the rounds under a policy that picks victims and preemption modes at random")
    engine.add_argument("--pipeline", action="store_true",
                        help="half the rounds run two pipeline stages (two worker processes)")
    engine.add_argument("--lora", type=int, default=0, metavar="N",
                        help="N random PEFT LoRA adapters; each request runs one of them or the base model")
    server = sub.add_parser("server", help="concurrent mixed traffic with cancellations against a local server")
    server.add_argument("--seed", type=int, default=0)
    server.add_argument("--waves", type=int, default=6)
    server.add_argument("--policy", default="fcfs")
    server.add_argument("--num-scheduler-steps", type=int, default=1)
    server.add_argument("--timeout", type=float, default=60.0, help="seconds a request may go without a byte")
    server.add_argument("--lora", type=int, default=0, metavar="N",
                        help="N random PEFT LoRA adapters, loaded and unloaded while requests run under them")
    server.add_argument("server_args", nargs="*", help="more `aserve serve` options, after --")
    args = parser.parse_args()
    if args.what == "engine" and args.pipeline and args.lora:
        parser.error("--pipeline and --lora: pipeline stages do not run LoRA adapters yet")
    sys.exit(soak_engine(args) if args.what == "engine" else asyncio.run(soak_server(args)))


if __name__ == "__main__":
    main()
