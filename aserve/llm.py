"""LLM: the offline API. `LLM(model).generate(prompts, params)` drives the engine core to completion."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from aserve.config import EngineConfig
from aserve.core.beam_search import length_normalized
from aserve.engine.engine_core import EngineCore
from aserve.errors import ConfigError
from aserve.inputs import admit_prompts, parse_prompts
from aserve.lora.request import LoRARequest
from aserve.metrics.loggers import StatLoggers
from aserve.outputs import (BeamSearchOutput, BeamSearchSequence, ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                            ScoringOutput, ScoringRequestOutput)
from aserve.pooling.params import PoolingParams
from aserve.pooling.score import cosine, pair_token_ids, pair_up
from aserve.sampling_params import BeamSearchParams, SamplingParams

PromptType = Any  # str | list[int] | {"prompt": str} | {"prompt_token_ids": list[int]}


class LLM:
    """`LLM(model=None)` loads the embedded default model; options are those of EngineConfig."""

    def __init__(self, model: str | None = None, **options):
        config = EngineConfig.from_kwargs(model, **options)
        config.verify()  # a wrong policy or model folder fails here, before any weights load
        if config.data_parallel_size != 1:
            raise ConfigError(f"data_parallel_size={config.data_parallel_size} needs AsyncLLM or the server (one "
                              f"engine-core process per replica); LLM runs a single engine core in this process")
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

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Invalid input raises ValueError
        before anything is queued, so one bad prompt never leaves half a batch behind. `lora_request`: one adapter
        for every prompt, or a list with one per prompt (None: the base model)."""
        prompts = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(params) != len(prompts) or len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params and "
                             f"{len(priorities)} priorities")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests")
        admitted = admit_prompts(self.engine.facts, prompts, params, self.engine.tokenizer.encode)
        for lora in dict.fromkeys(loras):  # each adapter read and checked before anything is queued
            self.engine.resolve_lora(lora)

        ids_in_order = []
        for prompt, prio, lora in zip(admitted, priorities, loras):
            request_id = f"gen-{self._counter}"
            self._counter += 1
            self.engine.add_request(prompt.token_ids, prompt.params, request_id=request_id, prompt=prompt.text,
                                    priority=prio, output_kind="final", lora_request=lora)
            ids_in_order.append(request_id)
        return self._run(ids_in_order, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (see BeamSearchParams), in input order: each prompt's beam_width hypotheses,
        best first, with the prompt in their `tokens` and `text` (vLLM's shape). Each prompt runs as one request
        whose beams share their blocks (core/beam_search.py)."""
        prompts = parse_prompts(prompts)
        admitted = admit_prompts(self.engine.facts, prompts, params.sampling_params(), self.engine.tokenizer.encode)
        self.engine.resolve_lora(lora_request)
        ids_in_order = []
        for prompt in admitted:
            request_id = f"beam-{self._counter}"
            self._counter += 1
            self.engine.add_request(prompt.token_ids, params, request_id=request_id, prompt=prompt.text,
                                    lora_request=lora_request)
            ids_in_order.append(request_id)
        return [BeamSearchOutput([BeamSearchSequence(
                    out.prompt_token_ids + o.token_ids, o.logprobs, o.cumulative_logprob, self._beam_text(out, o, params),
                    o.finish_reason, o.stop_reason,
                    length_normalized(o.cumulative_logprob, max(1, len(o.token_ids)), params.length_penalty))
                    for o in out.outputs])
                for out in self._run(ids_in_order, use_tqdm)]

    def _beam_text(self, out: RequestOutput, o, params: BeamSearchParams) -> str:
        """A hypothesis's text with its prompt's: decoded whole, as vLLM does; one a stop string cut keeps its cut
        text after the prompt's."""
        decode = self.engine.tokenizer.decode
        skip = params.skip_special_tokens
        if isinstance(o.stop_reason, str):
            return decode(out.prompt_token_ids, skip_special_tokens=skip) + o.text
        return decode(out.prompt_token_ids + o.token_ids, skip_special_tokens=skip)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a model started with runner="pooling"), in input order: `.outputs.embedding`.
        `pooling_params`: `dimensions` (Matryoshka models), `normalize` (default: as the model folder says)."""
        return [EmbeddingRequestOutput.of(out) for out in self._pool(prompts, pooling_params, "embed", use_tqdm)]

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The raw pooled hidden state of each prompt (`.outputs.data`, float32), neither cut nor normalized."""
        return self._pool(prompts, pooling_params, "encode", use_tqdm)

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each label's probability for each prompt (a *ForSequenceClassification model): `.outputs.probs`, the
        softmax of the head's logits (their sigmoid for a one-label head), in id2label's order."""
        return [ClassificationRequestOutput.of(out)
                for out in self._pool(prompts, pooling_params, "classify", use_tqdm)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """A score for each pair, in order: one text_1 against every text_2, or text_1[i] against text_2[i].
        A cross-encoder (a one-label classifier) reads each pair as one input: `.outputs.score` is its activated
        output, as sentence-transformers' CrossEncoder.predict gives it. An embedding model embeds every text
        once: the score is the cosine similarity of the pair's embeddings."""
        pairs = pair_up(text_1, text_2)
        spec = self.engine.pooling_spec
        if spec is not None and spec.labels is None:
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
            embedded = dict(zip(texts, self._pool(texts, params, "embed", use_tqdm)))
            return [ScoringRequestOutput(f"score-{i}", None, embedded[a].prompt_token_ids + embedded[b].prompt_token_ids,
                                         ScoringOutput(float(cosine(embedded[a].outputs.data, embedded[b].outputs.data))))
                    for i, (a, b) in enumerate(pairs)]
        prompts = pair_token_ids(self.engine.tokenizer, pairs, truncate_prompt_tokens)
        return [ScoringRequestOutput.of(out) for out in self._pool(prompts, None, "score", use_tqdm)]

    def _pool(self, prompts, pooling_params: PoolingParams | None, task: str, use_tqdm: bool):
        """Admit every prompt (one forward pass each, nothing sampled), refusing before anything is queued."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task=task)
        prompts = parse_prompts(prompts)
        admitted = admit_prompts(self.engine.facts, prompts, SamplingParams(max_tokens=1),
                                 self.engine.tokenizer.encode, keep_last=params.truncate_prompt_tokens)
        self.engine.check_pooling(params)
        ids_in_order = []
        for prompt in admitted:
            request_id = f"pool-{self._counter}"
            self._counter += 1
            self.engine.add_request(prompt.token_ids, request_id=request_id, prompt=prompt.text,
                                    output_kind="final", pooling_params=params)
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
                    if isinstance(output, RequestOutput):
                        out_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                        f"output: {out_tokens / elapsed:.2f} toks/s", refresh=False)
                    bar.update(1)
        bar.close()
        return [done[r] for r in request_ids if r in done]
