"""ModelRunner: owns the model and the paged KV cache; turns a SchedulerOutput into one forward pass.

All scheduled tokens of all requests go in one flat row (decode tokens first, then prefill chunks),
with their positions, cache slots and the block tables attention reads through. Only the rows that
sample are projected to logits.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from aserve.attention import Attention, AttentionBackend, BatchLayout, kv_quant, select_backend
from aserve.attention.backend import batch_order
from aserve.core.scheduler import SchedulerOutput
from aserve.lora import layers as lora_layers
from aserve.lora.cache import LoRASlots
from aserve.models.interface import CausalLM
from aserve.structured_output.bitmask import apply_grammar_bitmask
from aserve.worker.host_memory import keep_large_allocations_in_heap, lazy_zeros
from aserve.worker.request_state import ProposalRow, RequestState
from aserve.worker.sampler import (SampleResult, beam_log_normalizers, plain_draw, plain_greedy, sample,
                                   step_draws)

log = logging.getLogger("aserve")

# The most rows a step runs in one call of the C++ stack (ModelRunner._decode_steps). Alternated in one engine
# (tools/step_ab.py --compare one-call, bench model, 8 steps a scheduling, AMD EPYC Zen 5, 7699da2) the call took
# 0.95x the step-by-step time at 16 rows and 0.97x at 32, but 1.01-1.03x at 64, where the step's Python is ~1% of it.
ONE_CALL_MAX_ROWS = 32


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    a = model.shape
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * dtype.itemsize


@dataclass
class ModelRunnerOutput:
    """What one step produced, by request id: a sampled token (or an error) and any new prompt logprobs; for a
    pooling request whose prompt ended this step, its pooled vector (float32, on the host): a classifier's is
    its labels' logits. With a draft model, its proposals for the requests it drafts for."""
    sampled: dict[str, SampleResult] = field(default_factory=dict)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # a draft model's proposals, for the next step
    # A pipeline stage before the last: what it hands the next stage (its hidden states); never leaves the rank.
    intermediate: tuple | None = None


# A lazily zeroed KV cache (host_memory.lazy_zeros) pays a page fault on the first write to each of its 4 KiB
# pages, inside a step: on the 2-core VMs measured, ~6 us a page, about 4% of the bench model's 64 x 128/128
# run. So the blocks handed out first are faulted in at start-up instead, up to this much memory (~0.6 s for
# 737 MB there), the rest on first use; vLLM zeroes its whole cache at start-up.
PREFAULT_MAX_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, model: CausalLM, dtype: torch.dtype, block_size: int, kv_cache_memory: int,
                 swap_space: int = 0, attention_backend: str | AttentionBackend | None = None,
                 kv_cache_dtype: str = "auto", kv_scales: dict[int, tuple[float, float]] | None = None,
                 calculate_kv_scales: bool = False, prefault_tokens: int = 0, kv_block_layers: int | None = None):
        self.model = model
        self.requests: dict[str, RequestState] = {}  # the worker's own state of every request it has run
        self.device = next(model.parameters()).device
        self.backend = (attention_backend if not isinstance(attention_backend, (str, type(None)))
                        else select_backend(attention_backend, self.device))
        self.dtype = dtype
        # An FP8 cache holds bytes (uint8): blocks, swaps and copies are byte copies; the backend dequantizes.
        self.kv_format = kv_quant.resolve(kv_cache_dtype)
        self.backend.kv_format = self.kv_format
        self.kv_dtype = torch.uint8 if self.kv_format else self.backend.kv_cache_dtype(dtype)
        self.kv_cache_dtype = self.kv_format.name if self.kv_format else str(self.kv_dtype).replace("torch.", "")
        if self.kv_format:
            kv_quant.set_scales([m for m in model.modules() if isinstance(m, Attention)], kv_scales or {},
                                calculate_kv_scales)
        self.block_size = block_size
        # `kv_block_layers`: a pipeline stage counts its blocks as the stage with the most layers does, so that
        # every stage has as many blocks as the scheduler hands out
        per_block = kv_bytes_per_block(model, block_size, self.kv_dtype)
        if kv_block_layers:
            per_block = per_block // model.shape.num_layers * kv_block_layers
        self.num_blocks = kv_cache_memory // per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory ({kv_cache_memory} bytes) is smaller than one KV block "
                             f"({per_block} bytes at block_size {block_size})")
        on_cpu = self.device.type == "cpu"
        if on_cpu:
            keep_large_allocations_in_heap()
        a = model.shape
        self.num_kv_heads = a.num_kv_heads
        # zeros: unwritten slots are masked, but must not hold NaNs (0 * NaN is NaN in the value product).
        # One block more than the budget: the null block, which pads block tables and is never handed out.
        self.null_block = self.num_blocks
        self.num_physical_blocks = self.num_blocks + 1
        shape = self.backend.kv_cache_shape(a.num_layers, self.num_physical_blocks, block_size, a.num_kv_heads,
                                            a.head_dim)
        self.block_dim = self.backend.block_dim
        self.kv_cache = (lazy_zeros(shape, self.kv_dtype) if on_cpu
                         else torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
        if on_cpu and prefault_tokens and model.shape.causal:  # the pool hands out blocks 0, 1, 2, ... first
            count = min(self.num_blocks, -(-prefault_tokens // block_size), PREFAULT_MAX_BYTES // per_block)
            started = time.perf_counter()
            self.kv_cache.narrow(self.block_dim, 0, count).zero_()
            log.info("KV cache: the first %d blocks' memory (%.0f MiB) faulted in at start-up in %.2f s "
                     "(kv_cache_prefault_tokens)", count, count * per_block / 2**20, time.perf_counter() - started)
        self.layer_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(a.num_layers)]
        # The host swap pool: pinned memory for non-blocking copies on CUDA, a separate host tensor on the CPU.
        self.num_host_blocks = swap_space // per_block
        host_shape = self.backend.kv_cache_shape(a.num_layers, self.num_host_blocks, block_size, a.num_kv_heads,
                                                 a.head_dim)
        self.host_cache = (torch.zeros(host_shape, dtype=self.kv_dtype, pin_memory=True) if not on_cpu
                           else lazy_zeros(host_shape, self.kv_dtype))
        # An encoder (bidirectional attention) writes nothing to the cache: its blocks need no zeroing, and on
        # the CPU their lazily zeroed pages are never touched.
        self.keeps_kv = model.shape.causal
        self.pools = False  # the pooling runner (set by the worker): requests pool their prompt, nothing is sampled
        self.lora: LoRASlots | None = None  # multi-LoRA: the adapters' device slots (enable_lora)
        self.lora_step: lora_layers.LoRAStep | None = None  # this step's token -> slot mask, read by every layer
        self.drafter = None  # speculative decoding's draft model (worker.drafter.Drafter), on the sampling rank

    def enable_lora(self, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        """Give the model's adaptable linear layers their LoRA deltas, fed by `max_loras` device slots."""
        targets = lora_layers.target_shapes(self.model)
        self.lora_step = lora_layers.LoRAStep(max_loras, max_rank, self.dtype, self.device)
        layers = lora_layers.attach(self.model, self.lora_step, self.dtype, self.device)
        self.lora = LoRASlots(layers, targets, self.model.shape.num_layers, max_loras, max_rank, max_cpu_loras,
                              self.dtype)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        device, host = _index(pairs)
        blocks = self.kv_cache.index_select(self.block_dim, device.to(self.device))
        # A blocking copy: index_copy_ reads the host tensor at once, before a non-blocking copy would land.
        self.host_cache.index_copy_(self.block_dim, host, blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        host, device = _index(pairs)
        blocks = self.host_cache.index_select(self.block_dim, host)
        self.kv_cache.index_copy_(self.block_dim, device.to(self.device), blocks.to(self.device, non_blocking=True))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src, dst = (t.to(self.device) for t in _index(pairs))
        self.kv_cache.index_copy_(self.block_dim, dst, self.kv_cache.index_select(self.block_dim, src))

    # -- the worker's request states ---------------------------------------------------------------

    def update_states(self, sched: SchedulerOutput) -> None:
        """Fold the step's plain data into the persistent per-request states."""
        for request_id in sched.finished_ids:
            self.requests.pop(request_id, None)
            if self.drafter is not None:
                self.drafter.forget(request_id)
        for new in sched.new_requests:
            if self.drafter is not None:  # an id used again: nothing of the earlier request's drafts holds
                self.drafter.forget(new.request_id)
            state = self.requests[new.request_id] = RequestState(
                new.request_id, new.prompt_token_ids, new.params, new.block_table, new.num_computed_tokens, new.lora,
                new.pooling)
            if new.output_token_ids:
                state.replace_output(new.output_token_ids)
        for diff in sched.cached_requests:
            state = self.requests[diff.request_id]
            state.num_computed_tokens = diff.num_computed_tokens
            if diff.output_token_ids is not None:
                state.replace_output(diff.output_token_ids)
            if diff.replace_blocks:
                state.block_table = list(diff.new_block_ids)
            else:
                state.block_table.extend(diff.new_block_ids)

    def not_filled(self, sched: SchedulerOutput, block_ids: list[int]) -> list[int]:
        """Of fresh blocks, those this step's tokens do not fill. A block the step fills has every layer's slots
        written (write_kv) before that layer's attention reads any, so what an earlier owner left there is never
        seen, and zeroing it first only wrote its bytes twice: a 512-token prefill step of the bench model zeroed 32
        blocks, 11.8 MB of cache, ~1.5% of the step on a Xeon with AMX. (After update_states: each request's
        num_computed_tokens is where its tokens this step start.) A multi-step batch fills nothing for sure: its steps
        stop early where a row's logits fail."""
        if sched.num_steps > 1:
            return block_ids
        bs, filled = self.block_size, set()
        for request_id, n in sched.num_scheduled_tokens:
            if n >= bs:
                req = self.requests[request_id]
                start = req.num_computed_tokens
                filled.update(req.block_table[-(-start // bs):(start + n) // bs])
        return [block for block in block_ids if block not in filled] if filled else block_ids

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero these blocks in every layer. On the CPU one block at a time: index_fill_ over the block dimension
        took 26 us a block against 4-5 us for a block's view zeroed (bench model's cache, bf16), the ~4 fresh blocks
        of a 64-request decode step 106 against 17 us. Elsewhere one index_fill_, whose index must be int64: an
        empty list (every fresh block filled, see not_filled) made a float tensor that CUDA refused."""
        if not block_ids:
            return
        if self.device.type != "cpu":
            index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
            self.kv_cache.index_fill_(self.block_dim, index, 0)
            return
        for block_id in block_ids:
            self.kv_cache.select(self.block_dim, block_id).zero_()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, intermediate: tuple | None = None) -> ModelRunnerOutput:
        """One step. A pipeline stage after the first takes `intermediate` from the stage before it."""
        self.update_states(sched)
        # Order matters: save swapped-out blocks before anyone reuses them, then restore, then copy-on-write.
        if sched.swap_out:
            self.swap_out(sched.swap_out)
        if sched.blocks_to_zero and self.keeps_kv:  # after swap-out: a victim's block may be handed to someone else in the same step
            self.zero_blocks(self.not_filled(sched, sched.blocks_to_zero))
        if sched.swap_in:
            self.swap_in(sched.swap_in)
        if sched.copies:
            self.copy_blocks(sched.copies)
        result = ModelRunnerOutput()
        if not sched.num_scheduled_tokens:
            return result
        if sched.num_steps > 1:
            self._run_steps(sched.num_steps, [self.requests[rid] for rid, _ in sched.num_scheduled_tokens], result)
            return result
        if intermediate is None and self._one_call_step(sched, result):
            return result
        keyed = sorted(((batch_order(n, req.num_computed_tokens, req.num_prompt_tokens), req, n)
                        for req, n in ((self.requests[rid], n) for rid, n in sched.num_scheduled_tokens)),
                       key=lambda x: x[0])
        batch, orders = [(req, n) for _, req, n in keyed], [order for order, _, _ in keyed]
        input_ids, positions, meta, sample_rows, sample_reqs = self._prepare(batch, orders, sched.spec_token_ids)
        hidden = self._forward(batch, input_ids, positions, meta, intermediate)
        if isinstance(hidden, tuple):  # a pipeline stage before the last: the next one takes it from here
            result.intermediate = hidden
            return result
        result.prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if self.pools:  # the pooling runner: generation steps never walk the batch for it
            result.pooled = self._pool(batch, hidden)
        if sample_reqs:  # else only prefill chunks that do not reach the end of their prompts
            logits = self.model.compute_logits(hidden if sample_rows is None else hidden[sample_rows.to(self.device)])
            if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples (see append_sampled)
                return result
            # Sampling stays on the logits' device; only token ids and the logprobs asked for come back.
            normalizers = None
            if sched.structured_request_ids:
                normalizers = beam_log_normalizers(logits, sample_reqs)  # before the mask: see the function
                apply_grammar_bitmask(logits, [r.request_id for r in sample_reqs], sched.structured_request_ids,
                                      sched.grammar_bitmask)
            rows = sample(logits, sample_reqs, normalizers)
            for state, sampled in _per_request(sample_reqs, rows, sched.spec_token_ids):
                if sampled.error is None and state.params.beam is None:  # the engine picks a beam's token
                    for token_id in sampled.token_ids:
                        state.append_token(token_id)
                result.sampled[state.request_id] = sampled
        if self.drafter is not None and sched.draft_request_ids:
            drafting = set(sched.draft_request_ids)
            result.drafts = self.drafter.propose([x for x in batch if x[0].request_id in drafting], result.sampled)
        return result

    def _forward(self, batch: list[tuple[RequestState, int]], input_ids: torch.Tensor, positions: torch.Tensor, meta,
                 intermediate: tuple | None = None):
        """The model over a prepared batch: its last hidden states, or a pipeline stage's hand-over."""
        if self.device.type != "cpu":  # built on the host; the backend moves its own metadata
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        if self.lora is not None:
            self._map_adapters(batch)
        try:
            return (self.model(input_ids, positions, self.layer_caches, meta) if intermediate is None
                    else self.model(input_ids, positions, self.layer_caches, meta, intermediate))
        finally:
            if self.lora is not None:
                self.lora.release()
                self.lora_step.clear()

    def _run_steps(self, num_steps: int, reqs: list[RequestState], result: ModelRunnerOutput) -> None:
        """Multi-step decoding (SchedulerOutput.num_steps): decode steps of the same requests in a row, each
        sampling every request's next token and taking it as the next step's input, their slots allocated by the
        scheduler. A request's SampleResult is its last step's, the earlier steps' in `accepted` (as a request's
        accepted proposals are). A row whose logits fail ends the steps there: the others keep that step's tokens,
        and that request its error at the first step, else the tokens before it (the next step runs its position
        again, and a fault that stays fails it there, as it would have without the steps). Plain greedy rows run
        their steps, and plainly drawn ones theirs, in one call of the model where it can (`_decode_steps`), up to a
        step with such a row, which then runs again here."""
        batch = [(req, 1) for req in reqs]
        steps: list[list[SampleResult]] = [[] for _ in reqs]
        token_ids = [req.all_token_ids[req.num_computed_tokens] for req in reqs]
        inputs = self._step_inputs(reqs, num_steps)
        for row in self._decode_steps(reqs, token_ids, inputs) if self._one_call(reqs) else ():
            for req, token_id, earlier in zip(reqs, row, steps):
                req.append_token(token_id)
                earlier.append(SampleResult(token_id))
            token_ids = row
        for i in range(len(steps[0]), num_steps):
            logits = self.model.compute_logits(self._forward(batch, torch.tensor(token_ids), inputs.positions[i],
                                                             self._step_metadata(inputs, i)))
            rows = sample(logits, reqs)
            failed = False
            for req, sampled, earlier in zip(reqs, rows, steps):
                if sampled.error is None:  # (its num_computed_tokens comes with the next step, as after one step)
                    req.append_token(sampled.token_id)
                    earlier.append(sampled)
                else:
                    failed = True
                    if not earlier:
                        earlier.append(sampled)
            if failed:
                break
            token_ids = [sampled.token_id for sampled in rows]
        for req, earlier in zip(reqs, steps):
            last = earlier.pop()
            if last.error is None and earlier:
                last.accepted = earlier
            result.sampled[req.request_id] = last

    def _one_call_step(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> bool:
        """A step of decode rows alone, checking no proposals, with nothing else to do (no grammar, draft model or
        pooling): through the model's one-call decode steps (`_decode_steps`) as a batch of one step. Whether it
        ran; where it did not (other rows, a model that cannot, a row with no token), the step runs the usual way."""
        if sched.spec_token_ids or sched.structured_request_ids or self.drafter is not None or self.pools:
            return False
        reqs = []
        for request_id, n in sched.num_scheduled_tokens:
            req = self.requests[request_id]
            own = req.num_prompt_tokens <= req.num_computed_tokens == req.num_tokens - 1  # (not a prompt's last token)
            if n != 1 or not own:
                return False
            reqs.append(req)
        if not self._one_call(reqs):
            return False
        rows = self._decode_steps(reqs, [req.all_token_ids[-1] for req in reqs], self._step_inputs(reqs, 1))
        if not rows:
            return False
        for req, token_id in zip(reqs, rows[0]):
            req.append_token(token_id)
            result.sampled[req.request_id] = SampleResult(token_id)
        return True

    def _one_call(self, reqs: list[RequestState]) -> bool:
        """Whether `_decode_steps` may run these rows: up to ONE_CALL_MAX_ROWS of them, each plain greedy
        (sampler.plain_greedy: the argmax and nothing else) or a plain draw (sampler.plain_draw: over its
        temperature and nothing else), no adapters, on the CPU, a model with decode_steps."""
        return (self.device.type == "cpu" and len(reqs) <= ONE_CALL_MAX_ROWS and hasattr(self.model, "decode_steps")
                and all(r.lora is None and (plain_greedy(r) or plain_draw(r)) for r in reqs))

    def _decode_steps(self, reqs: list[RequestState], token_ids: list[int], inputs: StepInputs) -> list[list[int]]:
        """The tokens of a batch of decode rows that take one call (`_one_call`), a list a step, from one call of
        the model (LlamaForCausalLM.decode_steps: the C++ stack runs the steps, their logits and their tokens, each
        step's the next one's input), up to the first step with a row that has no token (its logits NaN or
        unusable), which the caller runs again. Drawn rows' uniforms are drawn for every step first, and the
        generators left as if only the steps that ran had drawn. Empty where the model cannot. The caller checks
        `_one_call` first (once a step). Why: see DecoderStack::decode_steps."""
        drawn = [i for i, r in enumerate(reqs) if not r.params.greedy]
        keep, extra = None, ()
        if drawn:
            draws, keep = step_draws([reqs[i] for i in drawn], len(inputs.positions))
            extra = (*draws, torch.tensor(drawn) if len(drawn) < len(reqs) else None)
        tokens = self.model.decode_steps(torch.tensor(token_ids), inputs.positions, inputs.slots, inputs.tables,
                                         inputs.positions + 1, self.layer_caches, self.backend, *extra)
        rows = [] if tokens is None else tokens.tolist()
        ran = next((i for i, row in enumerate(rows) if min(row) < 0), len(rows))
        if keep is not None:
            keep(ran)
        return rows[:ran]

    def _step_inputs(self, reqs: list[RequestState], num_steps: int) -> StepInputs:
        """What the steps of a multi-step batch share, made once (the scheduler allocated all the steps' slots):
        the block tables, and the positions and slots of all the steps as rows of one tensor each (at batch 1,
        flat_batch's tensors, made each step, took ~30 us of a ~2 ms GPTQ step's Python)."""
        bs = self.block_size
        block_tables = [req.block_table for req in reqs]
        starts = [req.num_computed_tokens for req in reqs]
        positions = torch.tensor([[start + i for start in starts] for i in range(num_steps)])
        slots = torch.tensor([[table[(start + i) // bs] * bs + (start + i) % bs
                               for table, start in zip(block_tables, starts)] for i in range(num_steps)])
        return StepInputs(self.padded_tables(block_tables), starts, positions, slots)

    def _step_metadata(self, inputs: StepInputs, i: int):
        """Step i's attention metadata."""
        starts = [start + i for start in inputs.starts]
        layout = BatchLayout(inputs.positions[i], inputs.slots[i], inputs.tables, starts, [1] * len(starts),
                             len(starts), self.block_size, self.num_physical_blocks)
        return self.backend.build_metadata(layout, self.num_kv_heads)

    def _map_adapters(self, batch: list[tuple[RequestState, int]]) -> None:
        """Slots for the step's adapters (loading them as needed) and the step's token -> slot grouping."""
        slots = self.lora.acquire([req.lora for req, _ in batch if req.lora is not None])
        self.lora_step.set([slots[req.lora.identity] if req.lora is not None else None for req, _ in batch],
                           [n for _, n in batch])

    def append_sampled(self, tokens: dict[str, list[int]]) -> None:
        """Tensor parallelism: the tokens rank 0 sampled, appended on a rank that gathered no logits, so its
        requests' tokens stay those of rank 0 (who appends its own as it samples)."""
        for request_id, token_ids in tokens.items():
            state = self.requests.get(request_id)
            if state is not None and state.params.beam is None:
                for token_id in token_ids:
                    state.append_token(token_id)

    def _pool(self, batch: list[tuple[RequestState, int]], hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pooling requests: fold this chunk's hidden states into their pooled state (a mean accumulates over
        chunked-prefill chunks); those whose prompt ended here get their vector."""
        pooled: dict[str, torch.Tensor] = {}
        row = 0
        for req, n in batch:
            if req.pooling is not None:
                start, rows = req.num_computed_tokens, hidden[row:row + n]
                if req.pooling == "mean":
                    part = rows.float().sum(0)
                    req.pool_sum = part if req.pool_sum is None else req.pool_sum + part
                elif req.pooling == "cls" and start == 0:
                    req.pool_first = rows[0].float()
                if start + n == req.num_prompt_tokens:
                    pooled[req.request_id] = {"mean": lambda: req.pool_sum / req.num_prompt_tokens,
                                              "cls": lambda: req.pool_first,
                                              "last": lambda: rows[-1].float()}[req.pooling]()
            row += n
        if pooled and getattr(self.model, "num_labels", 0):  # a classifier: its head, on the step's vectors at once
            logits = self.model.classify(torch.stack(list(pooled.values())).to(self.dtype)).float()
            pooled = dict(zip(pooled, logits))
        return {request_id: vector.cpu() for request_id, vector in pooled.items()}

    def _prompt_logprobs(self, batch: list[tuple[RequestState, int]], hidden: torch.Tensor) -> dict[str, list]:
        """For requests that asked: the log-probability of each prompt token given the ones before it."""
        found: dict[str, list] = {}
        row = 0
        for req, n in batch:
            k = req.params.prompt_logprobs
            if k is None:
                row += n
                continue
            start = req.num_computed_tokens
            # positions start..start+n-1 predict tokens start+1..; only those inside the prompt, once each
            first = max(start, req.num_prompt_logprobs)
            last = min(start + n, req.num_prompt_tokens - 1)
            if first < last:
                logits = self.model.compute_logits(hidden[row + first - start:row + last - start])
                if logits is None:  # a tensor-parallel rank other than 0 (it took part in the gather)
                    req.num_prompt_logprobs = last
                    row += n
                    continue
                logprobs = logits.float().log_softmax(dim=-1)  # on the logits' device: a few numbers come back
                targets = req.all_token_ids[first + 1:last + 1]
                index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
                chosen = logprobs.gather(1, index).squeeze(1).tolist()
                tops = logprobs.topk(k, dim=-1) if k else None
                top_ids, top_vals = (tops.indices.tolist(), tops.values.tolist()) if k else ([], [])
                entries = found.setdefault(req.request_id, [])
                for j, (token, lp) in enumerate(zip(targets, chosen)):
                    top = list(zip(top_ids[j], top_vals[j])) if k else []
                    entries.append((token, lp, top))
                req.num_prompt_logprobs = last
            row += n
        return found

    def _prepare(self, batch: list[tuple[RequestState, int]], orders: list[int], spec_token_ids: dict[str, list[int]]):
        """The step's flat inputs. A request checking proposals runs its next token and the proposals after it, and
        samples at each of those positions (a ProposalRow each). The rows to sample are None where they are all."""
        token_ids: list[int] = []
        starts, counts, sample_rows, sample_reqs = [], [], [], []
        for req, n in batch:
            start = req.num_computed_tokens
            spec = spec_token_ids.get(req.request_id, ())
            own = n - len(spec)
            token_ids.extend(req.all_token_ids[start:start + own])
            token_ids.extend(spec)
            starts.append(start)
            counts.append(n)
            if spec:
                sample_rows.extend(range(len(token_ids) - 1 - len(spec), len(token_ids)))
                q = self.drafter.distributions(req.request_id, spec) if self.drafter is not None else None
                sample_reqs.extend(ProposalRow(req, spec[:j], q[j] if q is not None and j < len(spec) else None,
                                               spec[j] if j < len(spec) else None) for j in range(len(spec) + 1))
            elif start + n == req.num_tokens and req.pooling is None:
                sample_rows.append(len(token_ids) - 1)
                sample_reqs.append(req)
        positions, meta = self.flat_batch([req.block_table for req, _ in batch], starts, counts, orders)
        every_row = len(sample_rows) == len(token_ids)  # each row samples (rows ascend): no gather of the hidden states
        rows = None if every_row else torch.tensor(sample_rows, dtype=torch.long)
        return torch.tensor(token_ids), positions, meta, rows, sample_reqs

    def padded_tables(self, block_tables: list[list[int]]) -> torch.Tensor:
        """The block tables as one [rows, widest] tensor, the shorter ones padded with the null block."""
        width = max(map(len, block_tables))
        null = [self.null_block]
        return torch.tensor([table + null * (width - len(table)) for table in block_tables], dtype=torch.long)

    def flat_batch(self, block_tables: list[list[int]], starts: list[int], counts: list[int], orders: list[int]):
        """Positions and attention metadata of a flat batch: row i runs counts[i] tokens from position starts[i]
        through block_tables[i]; the rows come sorted by their batch_order (`orders`): decodes first."""
        bs = self.block_size
        tables = self.padded_tables(block_tables)
        num_decode, num_short = orders.count(0), orders.count(1)
        if num_decode == len(counts):  # decode rows only: a token each, at its start (a tenth of a batch-1 step's
            positions = torch.tensor(starts)  # Python went to the general index arithmetic below)
            slot_mapping = torch.tensor([table[p // bs] * bs + p % bs for table, p in zip(block_tables, starts)])
        else:
            starts_t = torch.tensor(starts)
            counts_t = torch.tensor(counts)
            row_of_token = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
            first_token = torch.cumsum(counts_t, 0) - counts_t
            positions = starts_t[row_of_token] + torch.arange(int(counts_t.sum())) - first_token[row_of_token]
            slot_mapping = tables[row_of_token, positions // bs] * bs + positions % bs
        layout = BatchLayout(positions, slot_mapping, tables, starts, counts, num_decode, bs, self.num_physical_blocks,
                             num_short)
        return positions, self.backend.build_metadata(layout, self.num_kv_heads)


def _per_request(rows: list, results: list[SampleResult], spec_token_ids: dict[str, list[int]]):
    """The step's sampled rows back to one result per request: a request that checked proposals keeps those its
    own samples agree with (accept_proposals)."""
    i = 0
    while i < len(rows):
        row = rows[i]
        if isinstance(row, ProposalRow):
            spec = spec_token_ids[row.request_id]
            yield row.state, accept_proposals(results[i:i + len(spec) + 1], spec)
            i += len(spec) + 1
        else:
            yield row, results[i]
            i += 1


def accept_proposals(results: list[SampleResult], spec: list[int]) -> SampleResult:
    """Exact verification of proposals that come without a distribution of their own (n-gram lookup): each
    position was sampled from the target as if the proposals before it were accepted, and a proposal stands while
    the target drew it. That accepts proposal d with probability p(d) and, on a rejection, gives a draw from p
    without d, renormalized: rejection sampling with q = 1 on d. Greedy rows accept while d is the argmax. After
    the last accepted proposal comes the sample there: the correction, or the bonus token when all stood."""
    accepted = 0
    while accepted < len(spec) and results[accepted].error is None and results[accepted].token_id == spec[accepted]:
        accepted += 1
    final = results[accepted]
    final.accepted = results[:accepted]
    return final


def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([a for a, _ in pairs]), torch.tensor([b for _, b in pairs])


class StepInputs(NamedTuple):
    """What the steps of a multi-step batch share (ModelRunner._step_inputs)."""
    tables: torch.Tensor  # [rows, widest] block tables, padded with the null block
    starts: list[int]  # each row's first position
    positions: torch.Tensor  # [steps, rows]: step i's in row i
    slots: torch.Tensor  # [steps, rows]
