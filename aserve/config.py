"""Engine options in one place, with the parsing that the CLI, LLM and AsyncLLM share."""
from __future__ import annotations

import argparse
import logging
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from aserve.errors import ConfigError
from aserve.quantization import METHODS as QUANTIZATION_METHODS, resolve as resolve_quantization  # torch-free

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
DEFAULT_MODEL_NAME = "aserve-default"
log = logging.getLogger("aserve")

# vLLM engine arguments a ported script may pass that mean nothing here (with their harmless values).
VLLM_ONLY_OPTIONS = {"gpu_memory_utilization": None,
                     "enforce_eager": None, "trust_remote_code": None,
                     "disable_custom_all_reduce": None}


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int or a string such as '4GiB', '512MiB', '2GB', '1.5G' or '1000000'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"kv_cache_memory must be bytes or a size like '4GiB', got {value!r}")
    number, unit, suffix = float(m.group(1)), m.group(2).upper(), (m.group(3) or "").lower()
    base = 1000 if suffix == "b" and unit else 1024
    return int(number * base ** " KMGT".index(unit or " "))


DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; fp8 is fp8_e4m3


def option(default, help: str, **cli):
    """An EngineConfig field with its command-line help (and, in `cli`, `flag`, `choices`): the flags of
    `aserve`, `aserve bench throughput` and `aserve bench policies` are generated from these."""
    return field(default=default, metadata={"help": help, **cli})


# The pooling runner's default step on the CPU (`aserve bench embed`: 512 prompts of 16-256 tokens, bf16, Sapphire
# Rapids AMX, 2 threads). The bench model (a decoder) embedded 33.4 sentences/s at 512 tokens a step, 40.7 at 2048,
# 42.8 at 4096, 40.3 at 8192 (separate runs; again at f13a56f: 40.0 at 4096, 37.5 and 37.9 at 8192). An encoder's
# prompts run whole and its attention is cheaper per token: the BERT-base-shaped embedder (make_bench_model.py
# --bert), alternated in one process, 54.9/60.5/59.6 at 4096 against 58.3/66.0/62.5 at 8192.
POOLING_TOKEN_BUDGET = 4096
ENCODER_TOKEN_BUDGET = 8192


@dataclass
class EngineConfig:
    """Every engine option; `LLM(**options)`, `AsyncLLM(**options)` and the CLI flags take the same names."""
    model: str | None = option(None, "local Hugging Face folder (default: the embedded model)")
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's)")
    dtype: str = option("auto", "weights and activations; auto follows the checkpoint and the hardware",
                        choices=DTYPES)
    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory: int | str = option("4GiB", "KV cache budget: bytes or a size such as 2GiB")
    kv_cache_prefault_tokens: int = option(32768, "on the CPU, the KV memory of the first blocks handed out, for "
                                                  "this many tokens (at most 1 GiB), is faulted in at start-up "
                                                  "rather than on first use in a step; 0: all on first use")
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's)")
    max_num_seqs: int = option(256, "most sequences in one batch (each beam of a beam search counts)")
    max_num_batched_tokens: int | None = option(None, "token budget of one step (prefill chunks and decodes "
                                                      "together); default 512 on the CPU, 2048 on a GPU (the "
                                                      "pooling runner: 4096, 16384; 8192, 32768 for an encoder)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompts' shared prefixes")
    policy: str | object = option("fcfs", "scheduling policy: an installed name, module:Class or "
                                          "path/to/file.py:Class (or, in Python, a class or an instance)")
    policy_options: dict | None = option(None, "an option for the policy's constructor, e.g. aging=0.5 (repeatable)",
                                         flag="--policy-option")
    swap_space: float | str = option(4, "host memory for swapped-out KV blocks: GiB (a number) or a size string")
    seed: int = option(0, "random seed of sampling without a per-request seed")
    served_model_name: str | None = option(None, "the model name clients use (default: --model)")
    runner: str = option("auto", "generate text, or pool each prompt into one vector (embeddings); auto: pooling "
                                 "for a sentence-transformers folder, else generate", choices=("auto", "generate",
                                                                                              "pooling"))
    disable_log_stats: bool | None = option(None, "the periodic stats line; default: off offline, on when serving")
    max_n: int = option(32, "the largest n (samples per prompt) a request may ask: each costs as much as a request")
    max_waiting_requests: int | None = option(None, "refuse new requests (503 + Retry-After when serving) while "
                                                    "this many are waiting (default: no bound)")
    data_parallel_size: int = option(1, "engine-core replicas behind one server, each with its own model copy, "
                                        "KV cache (--kv-cache-memory each) and a 1/N share of the CPU threads; a "
                                        "request goes to the replica with the fewest in flight")
    attention_backend: str = option("auto", "attention kernels: auto (by device), torch or triton")
    device: str = option("auto", "where the model and its KV cache run: auto (the GPU when torch sees one, else "
                                 "cpu), cpu, cuda or cuda:N")
    kv_cache_dtype: str = option("auto", "KV cache storage: auto (the model's dtype), or fp8 (= fp8_e4m3) / "
                                         "fp8_e5m2: one byte a value with per-layer scales, so the same "
                                         "--kv-cache-memory holds 2x the blocks of a 16-bit cache (4x fp32)",
                                 choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = option(False, "with an fp8 KV cache and no scales in the checkpoint: estimate each "
                                              "layer's K and V scales from the first batch it sees (else 1.0)")
    quantization: str | None = option(None, "weights: int8 quantizes a 16/32-bit checkpoint at load (weight-only, "
                                            "per-output-channel scales); gptq and awq 4-bit checkpoints are "
                                            "recognised from config.json without it", choices=QUANTIZATION_METHODS)
    quantize_lm_head: bool = option(False, "the logits projection in int8 too: with --quantization int8, or the "
                                           "dense head of a GPTQ/AWQ checkpoint (a quantized copy when it is tied "
                                           "to the embedding)")
    num_scheduler_steps: int = option(1, "decode steps run for each scheduling (vLLM's multi-step scheduling): "
                                         "while every running request decodes and none waits, the engine's "
                                         "bookkeeping runs once per N tokens, and the tokens come N at a time")
    speculative_config: dict | str | None = option(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": N}", json=True)
    # multi-LoRA serving (aserve.lora)
    enable_lora: bool = option(False, "serve PEFT LoRA adapters named per request (lora_request), batched beside "
                                      "the base weights, never merged into them")
    max_loras: int = option(1, "with --enable-lora: the most distinct adapters in one step (device slots)")
    max_lora_rank: int = option(16, "with --enable-lora: the largest adapter rank served; a larger one is refused")
    max_cpu_loras: int | None = option(None, "with --enable-lora: loaded adapters kept in host memory, least "
                                             "recently used dropped first (default: max_loras)")
    # tensor parallelism (aserve.worker.multiproc_executor, aserve.models.parallel)
    tensor_parallel_size: int = option(1, "worker processes (ranks) the weights are split across, one rank each; "
                                          "--kv-cache-memory is per rank, and each rank holds its share of the KV "
                                          "heads")
    # pipeline parallelism: the layers split into stages, each stage a tensor-parallel group of its own
    pipeline_parallel_size: int = option(1, "pipeline stages the layers are split into (world = tensor x pipeline "
                                            "ranks); hidden states pass stage to stage")
    pp_layer_partition: str | None = option(None, "layers per pipeline stage, e.g. 4,4,5,3 (default: even, the "
                                                  "remainder to the stages before the last)")
    distributed_executor_backend: str = option("mp", "how the ranks start: mp (a process each on this machine, "
                                                     "`aserve worker` on others) or ray (placed on the Ray cluster at "
                                                     "RAY_ADDRESS; pip install 'aserve[ray]')")
    ray_cpus_per_rank: int = option(1, "with the ray backends: CPUs (and torch threads) each rank, or each "
                                       "data-parallel replica of one rank, reserves")
    data_parallel_backend: str = option("mp", "where data-parallel replicas run: mp (processes of this machine) or "
                                              "ray (each a Ray actor, placed on the cluster at RAY_ADDRESS)")
    distributed_init_method: str | None = option(None, "tcp://HOST:PORT where the ranks meet; HOST is node 0 "
                                                       "(default: MASTER_ADDR:MASTER_PORT when set, else a free "
                                                       "loopback port)")
    nnodes: int = option(1, "machines the ranks span, tensor_parallel_size x pipeline_parallel_size / nnodes on "
                            "each")
    node_rank: int = option(0, "this machine's index among --nnodes: 0 runs the engine, the others `aserve worker`")
    distributed_timeout: int = option(60, "seconds a rank waits in any collective before the engine gives up on "
                                          "the group (a hung or unreachable rank); a dead rank is seen at once")

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = str(DEFAULT_MODEL_DIR)
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        self.swap_space = (int(self.swap_space * 1024 ** 3) if isinstance(self.swap_space, (int, float))
                           else parse_memory(self.swap_space))
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        if self.kv_cache_prefault_tokens < 0:
            raise ValueError(f"kv_cache_prefault_tokens must be >= 0, got {self.kv_cache_prefault_tokens}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {self.max_waiting_requests}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_n"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
                             f"got {self.quantization!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes", "distributed_timeout"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1} (nnodes {self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({self.world_size}) must be a multiple "
                             f"of nnodes {self.nnodes} (the same number of ranks on every machine)")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and (self.nnodes > 1 or self.distributed_init_method):
            raise ValueError("with distributed_executor_backend ray, Ray places the ranks and picks where they meet: "
                             "drop --nnodes and --distributed-init-method")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be mp or ray, got {self.data_parallel_backend!r}")
        if self.ray_cpus_per_rank < 1:
            raise ValueError(f"ray_cpus_per_rank must be >= 1, got {self.ray_cpus_per_rank}")
        if self.pp_layer_partition is not None and self.pipeline_parallel_size == 1:
            raise ValueError("pp_layer_partition places layers on pipeline stages: it needs pipeline_parallel_size > 1")
        self._check_lora()
        self._check_scheduler_steps()
        from aserve.spec_decode.config import SpeculativeConfig  # torch-free

        SpeculativeConfig.parse(self.speculative_config)  # a bad one fails here, before any weights load
        if self.data_parallel_size > 1 and (self.nnodes > 1 or self.distributed_init_method):
            raise ValueError("data_parallel_size > 1 with a multi-node tensor-parallel group is not supported: every "
                             "replica's ranks would meet at the one --distributed-init-method")

    @property
    def world_size(self) -> int:
        """Ranks of the model's group: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_scheduler_steps(self) -> None:
        """Multi-step decoding runs its steps in the one worker that samples: not beside proposals, which a step
        checks in one forward, nor across ranks that would wait on each inner step's tokens."""
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.num_scheduler_steps == 1:
            return
        if self.speculative_config:
            raise ValueError("num_scheduler_steps > 1 and speculative_config are two ways of making several tokens "
                             "a step: choose one")
        if self.world_size > 1:
            raise ValueError(f"num_scheduler_steps > 1 runs in a single worker: not with tensor_parallel_size x "
                             f"pipeline_parallel_size = {self.world_size}")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    def verify(self) -> None:
        """Refuse a policy, a model folder or a weight format that cannot work, before any weights load (see
        check_before_loading)."""
        check_before_loading(self.model, self.policy, self.policy_options, self.quantization, self.quantize_lm_head)
        if self.runner == "generate" and self._pooling_only():
            raise ConfigError(f"model {self.model}: an encoder, classifier or bare decoder stack (no LM head) cannot "
                              f"generate; serve it with runner='pooling' (--runner pooling)")

    def token_budget(self, device: torch.device, encoder: bool = False) -> int:
        """max_num_batched_tokens, or the device's default. On the CPU a 512-token step loses no throughput to
        a 2048-token one (the GEMMs are as fast from M=128 up) while each step takes a quarter of the time: a
        burst of prompts reaches its first tokens sooner (bench model, 64 x 128/128 served at once on 2 AMD
        EPYC avx512_bf16 cores: TTFT p50 4.35 s at 2048, 3.76 at 1024, 3.68 at 512), and running requests wait
        less between tokens while prompts are prefilled. A GPU wants larger GEMMs. The pooling runner has no
        decode to keep waiting: larger steps, larger GEMMs (`encoder`: an encoder model's, larger still)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.resolved_runner == "pooling":
            budget = ENCODER_TOKEN_BUDGET if encoder else POOLING_TOKEN_BUDGET
            return budget if device.type == "cpu" else 4 * budget
        return 512 if device.type == "cpu" else 2048

    @property
    def resolved_runner(self) -> str:
        """`runner`, with auto decided from the model folder: pooling for a sentence-transformers folder, an
        encoder, a classifier or a bare decoder stack (no LM head), else generate."""
        if self.runner != "auto":
            return self.runner
        from aserve.pooling.params import is_sentence_transformers

        return "pooling" if self.model and (is_sentence_transformers(self.model) or self._pooling_only()) else "generate"

    def _pooling_only(self) -> bool:
        from aserve.models.registry import POOLING_ONLY, architecture, read_config

        try:
            return architecture(read_config(self.model)) in POOLING_ONLY
        except (OSError, ValueError):
            return False  # verify() says what is wrong with the folder

    @property
    def model_name(self) -> str:
        """The name clients and metrics use: --served-model-name, else the model folder as given."""
        if self.served_model_name:
            return self.served_model_name
        return DEFAULT_MODEL_NAME if self.model == str(DEFAULT_MODEL_DIR) else self.model

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        for name in set(kwargs) & set(VLLM_ONLY_OPTIONS):
            value = kwargs.pop(name)
            if value != VLLM_ONLY_OPTIONS[name]:
                log.warning("ignoring vLLM option %s=%r: it has no meaning in aserve", name, value)
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)


def check_before_loading(model: str | None, policy, policy_options: dict | None = None,
                         quantization: str | None = None, quantize_lm_head: bool = False) -> None:
    """Refuse a policy, a model folder or a weight format that cannot work: the checks read only config.json and
    the policy's class, so a wrong flag fails in well under a second instead of after the weights load."""
    from aserve.errors import ModelLoadError, ModelNotFoundError
    from aserve.models.registry import check_model_dir, read_config
    from aserve.policy import resolve_policy

    resolve_policy(policy, policy_options)
    model = model or str(DEFAULT_MODEL_DIR)
    try:
        check_model_dir(model)
        resolve_quantization(read_config(model), quantization, quantize_lm_head)
    except FileNotFoundError as exc:
        raise ModelNotFoundError(str(exc)) from None  # it names the missing path already
    except ValueError as exc:
        raise ModelLoadError(f"model {model}: {exc}") from None


# -- the command line: flags generated from EngineConfig's fields ---------------------------------------

def _number_or_size(text: str) -> float | str:
    """A number (of GiB, for swap_space) or a size string such as '512MiB', left to EngineConfig to parse."""
    try:
        return float(text)
    except ValueError:
        return text


def parse_key_values(items: list[str], flag: str) -> dict:
    """KEY=VALUE strings to a dict; values that read as numbers become numbers."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} wants KEY=VALUE, got {item!r}")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        options[key] = value
    return options


def _flag(f) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _kinds(hint) -> set[type]:
    """The types a field's annotation allows, None aside: `int | None` -> {int}."""
    return {a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)}


def _flag_spec(f, hint) -> dict:
    """argparse's keyword arguments for one field, from its type and metadata."""
    kinds = _kinds(hint)
    spec: dict = {"dest": f.name, "help": f.metadata["help"]}
    if f.metadata.get("json"):  # a JSON object as text; the field parses it
        spec["metavar"] = "JSON"
    elif bool in kinds:
        spec["action"] = argparse.BooleanOptionalAction
    elif dict in kinds:  # a repeatable KEY=VALUE flag; engine_options builds the dict
        spec.update(action="append", metavar="KEY=VALUE")
    elif kinds == {int}:
        spec["type"] = int
    elif kinds == {float, str}:
        spec["type"] = _number_or_size
    if "choices" in f.metadata:
        spec["choices"] = f.metadata["choices"]
    return spec


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                         defaults: dict | None = None) -> None:
    """Add a flag for every EngineConfig field (but `exclude`), with the field's default unless `defaults`
    gives a command's own; `engine_options(args)` turns the parsed flags back into EngineConfig options."""
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name in exclude:
            continue
        spec = _flag_spec(f, hints[f.name])
        default = (defaults or {}).get(f.name, f.default)
        if default is not None:
            spec["help"] += f" (default: {default})"
        group.add_argument(_flag(f), default=default, **spec)


def engine_options(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the flags add_engine_arguments added."""
    hints = typing.get_type_hints(EngineConfig)
    options = {}
    for f in fields(EngineConfig):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if dict in _kinds(hints[f.name]) and value is not None and not f.metadata.get("json"):
            value = parse_key_values(value, _flag(f))
        options[f.name] = value
    return options
