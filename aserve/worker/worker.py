"""Worker: one rank's device, model and KV cache, driven by plain step data (see core.scheduler.SchedulerOutput).

The engine core talks to it only through an Executor, with data that could cross a process boundary, so
the multi-process executor of tensor parallelism is one more implementation, not a rewrite.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from aserve.config import EngineConfig
from aserve.core.scheduler import SchedulerOutput
from aserve.hardware import resolve_device
from aserve.models.loader import checkpoint_kv_scales, load_model
from aserve.models.parallel import PipelineStage, TensorParallel
from aserve.spec_decode.config import SpeculativeConfig
from aserve.worker.drafter import Drafter, split_memory
from aserve.worker.model_runner import ModelRunner, ModelRunnerOutput


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine core needs to know of the loaded model and its cache (plain data)."""
    model_class: str
    model_config: dict
    dtype: str
    dtype_reason: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    num_blocks: int
    num_host_blocks: int
    attention_backend: str
    kv_cache_dtype: str  # the cache's storage: the model's dtype, or fp8_e4m3 / fp8_e5m2
    num_layers: int = 0
    causal: bool = True  # False: an encoder model, whose prompts the scheduler must not chunk
    lora_targets: dict | None = None  # with enable_lora: module name -> (in, out) features (lora.layers.target_shapes)


class Worker:
    """`tp` and `device`: a tensor-parallel rank's group (its slices of the model and its KV heads) and its own
    device (cuda:LOCAL_RANK), set by worker.tp_worker; one rank on `config.device` otherwise."""

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None, device: torch.device | None = None,
                 stage: PipelineStage | None = None, kv_block_layers: int | None = None):
        device = device or resolve_device(config.device)
        if device.type == "cuda":  # Triton launches on the current device, whatever its tensors' device is
            torch.cuda.set_device(device)
        loaded = load_model(config.model, config.dtype, device, max_model_len=config.max_model_len,
                            quantization=config.quantization, quantize_lm_head=config.quantize_lm_head, tp=tp,
                            stage=stage, large_steps=config.resolved_runner == "pooling")
        scales = checkpoint_kv_scales(config.model) if config.kv_cache_dtype != "auto" else None
        if scales and stage is not None:  # by the checkpoint's layer numbers; a stage numbers its own from 0
            scales = {i - stage.start: v for i, v in scales.items() if i in loaded.model.layer_range}
        spec = SpeculativeConfig.parse(config.speculative_config)
        drafts = spec is not None and spec.method == "draft_model"
        kv_memory, draft_memory = (split_memory(config.kv_cache_memory, loaded.model.shape, spec.model, loaded.dtype)
                                   if drafts else (config.kv_cache_memory, 0))
        self.runner = ModelRunner(loaded.model, loaded.dtype, config.block_size, kv_memory,
                                  config.swap_space, config.attention_backend, config.kv_cache_dtype, scales,
                                  config.calculate_kv_scales, config.kv_cache_prefault_tokens, kv_block_layers)
        self.runner.pools = config.resolved_runner == "pooling"
        if config.enable_lora:
            self.runner.enable_lora(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        if drafts and (tp is None or tp.rank == 0):  # the rank that samples drafts; the others only verify
            max_model_len = config.max_model_len or loaded.model.shape.max_position_embeddings
            self.runner.drafter = Drafter(spec, self.runner, draft_memory, max_model_len,
                                          config.token_budget(device), config.tokenizer or config.model)
        shape = loaded.model.shape
        self.info = WorkerInfo(type(loaded.model).__name__, loaded.config, str(loaded.dtype).replace("torch.", ""),
                               loaded.dtype_reason, shape.vocab_size, shape.max_position_embeddings,
                               loaded.eos_token_ids, self.runner.num_blocks, self.runner.num_host_blocks,
                               self.runner.backend.name, self.runner.kv_cache_dtype, shape.num_layers, shape.causal,
                               self.runner.lora.targets if self.runner.lora is not None else None)

    def execute(self, sched: SchedulerOutput, intermediate: tuple | None = None) -> ModelRunnerOutput:
        return self.runner.execute(sched, intermediate)
