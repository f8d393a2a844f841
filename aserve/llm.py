"""LLM: the offline API. `LLM(model).generate(prompts, params)` drives the engine core to completion."""
from __future__ import annotations

import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from aserve.config import EngineConfig
from aserve.engine.engine_core import EngineCore
from aserve.metrics.loggers import StatLoggers
from aserve.outputs import RequestOutput
from aserve.sampling_params import SamplingParams

PromptType = Any  # str | list[int] | {"prompt": str} | {"prompt_token_ids": list[int]}


class LLM:
    """`LLM(model=None)` loads the embedded default model; options are those of EngineConfig."""

    def __init__(self, model: str | None = None, **options):
        config = EngineConfig.from_kwargs(model, **options)
        self.engine = EngineCore(config)
        facts = self.engine.facts
        self.stats = StatLoggers(config.model_name, facts, facts.policy_name, facts.priority_classes,
                                 log_stats=config.disable_log_stats is False)
        self._counter = 0

    def get_metrics(self) -> list[tuple[str, dict, float]]:
        """The Prometheus samples a server would export: (name, labels, value) for each."""
        return self.stats.prometheus.samples()

    def _step(self):
        outputs = self.engine.step()
        self.stats.record(self.engine.take_stats())
        return outputs

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _normalize(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
            prompts = [list(prompts)]  # one prompt given as token ids
        result = []
        for p in prompts:
            if isinstance(p, str):
                result.append((p, self.engine.tokenizer.encode(p)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                result.append((p.get("prompt"), list(p["prompt_token_ids"])))
            elif isinstance(p, dict) and "prompt" in p:
                result.append((p["prompt"], self.engine.tokenizer.encode(p["prompt"])))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                result.append((None, list(p)))
            else:
                raise ValueError(f"a prompt must be a string, a list of token ids or a dict with 'prompt' or "
                                 f"'prompt_token_ids', got {type(p).__name__}")
        return result

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Invalid input raises ValueError
        before anything is queued, so one bad prompt never leaves half a batch behind."""
        items = self._normalize(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(items) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(params) != len(items) or len(priorities) != len(items):
            raise ValueError(f"got {len(items)} prompts but {len(params)} sampling params and "
                             f"{len(priorities)} priorities")
        for i, ((_, ids), sp) in enumerate(zip(items, params)):
            try:
                self.engine.validate(ids, sp)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None

        ids_in_order = []
        for (text, ids), sp, prio in zip(items, params, priorities):
            request_id = f"gen-{self._counter}"
            self._counter += 1
            self.engine.add_request(ids, sp, request_id=request_id, prompt=text, priority=prio, output_kind="final")
            ids_in_order.append(request_id)
        return self._run(ids_in_order, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        while len(done) < len(wanted) and self.engine.has_unfinished():
            for output in self._step():
                if output.finished and output.request_id in wanted:
                    done[output.request_id] = output
                    in_tokens += len(output.prompt_token_ids)
                    out_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                        f"output: {out_tokens / elapsed:.2f} toks/s", refresh=False)
                    bar.update(1)
        bar.close()
        return [done[r] for r in request_ids if r in done]
