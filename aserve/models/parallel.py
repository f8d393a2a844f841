"""Tensor parallelism inside a model: which slice of each weight a rank holds, and the two collectives that
put the slices back together (Megatron-LM's scheme, as vLLM and gpt-fast use it).

- Column-parallel (Q|K|V, gate|up, the LM head): a rank holds some rows of W, computes its own slice of the
  outputs, and needs no communication; the heads and the MLP's inner features that follow are its own.
- Row-parallel (o_proj, down_proj): a rank holds the matching columns of W, so its product is a partial sum
  of the full output; one all-reduce adds the ranks' partial sums.
- Vocab-parallel embedding: a rank holds a range of rows; ids outside it give zeros, and an all-reduce fills
  each row from the rank that holds it. The LM head's logits, one vocab range per rank, are gathered to rank 0,
  which samples.

KV heads are split with the query heads they serve; when there are fewer KV heads than ranks, each rank keeps
(a replica of) the one KV head its query heads read. A rank's KV cache holds only its own heads.

At one rank every helper here returns the plain layer (`Linear`, `nn.Embedding`), so TP=1 runs exactly the code
it ran before. A model asks `current()` for the group it is built for; the worker sets it with `building(tp)`
while it builds the model. Each sharded parameter records a `Split` (in its layer's `tp_splits`), which the
weight filler (models.interface.ParamFiller) reads to take only this rank's part of a checkpoint tensor, from the
file itself when the loader hands it safetensors slices.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from aserve.models.layers import Linear


class TensorParallel:
    """One rank's view of its tensor-parallel group: rank, size, and the collectives the model calls. The
    torch.distributed groups are attached after the rendezvous (worker.distributed), which comes after loading:
    building and filling the model needs only `rank` and `size`."""

    def __init__(self, rank: int = 0, size: int = 1):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside a group of {size}")
        self.rank, self.size = rank, size
        self.group = None  # the model's collectives (gloo on the CPU, NCCL on CUDA); None: the default group
        self.cpu_group = None  # step messages and Python objects: always gloo

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's vocab range of the logits [T, V/size] -> the whole row [T, V] on rank 0, None elsewhere
        (only rank 0 samples). The last range's padding (vocab not divisible by the ranks) is dropped."""
        if self.size == 1:
            return logits
        import torch.distributed as dist

        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits, parts, group_dst=0, group=self.group)  # the group's first rank (a stage's own group)
        return torch.cat(parts, dim=-1)[..., :vocab_size] if self.rank == 0 else None


SINGLE = TensorParallel()
_building: list[TensorParallel] = [SINGLE]


@dataclass(frozen=True)
class PipelineStage:
    """A pipeline stage's share of a model: its place among `size` stages and the layers it holds (`start` up to
    `end`; end None: to the last). Only the first stage embeds; only the last has the final norm and the head."""
    index: int = 0
    size: int = 1
    start: int = 0
    end: int | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)


WHOLE = PipelineStage()
_stages: list[PipelineStage] = [WHOLE]


def current() -> TensorParallel:
    """The group the model being built is for (one rank unless inside `building`)."""
    return _building[-1]


def current_stage() -> PipelineStage:
    """The pipeline stage the model being built is (the whole model unless inside `building`)."""
    return _stages[-1]


@contextlib.contextmanager
def building(tp: TensorParallel | None, stage: PipelineStage | None = None) -> Iterator[None]:
    _building.append(tp or SINGLE)
    _stages.append(stage or WHOLE)
    try:
        yield
    finally:
        _building.pop()
        _stages.pop()


def layer_partition(num_layers: int, num_stages: int, explicit: str | Sequence[int] | None = None) -> list[int]:
    """How many layers each pipeline stage holds: `explicit` ("4,4,5,3" or a list), checked, or an even split
    with the remainder going to the stages before the last, from the second-to-last backwards (vLLM's rule: the
    last stage also runs the head, the first the embedding)."""
    if explicit is not None and explicit != "":
        try:
            parts = [int(x) for x in (explicit.split(",") if isinstance(explicit, str) else explicit)]
        except ValueError:
            raise ValueError(f"pp_layer_partition must be layer counts like 4,4,5,3, got {explicit!r}") from None
        if len(parts) != num_stages or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(f"pp_layer_partition {','.join(map(str, parts))}: needs {num_stages} counts of at least 1 "
                             f"layer adding up to the model's {num_layers} layers")
        return parts
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} is more than the model's {num_layers} layers")
    parts = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        parts[-i] += 1
    return parts


def pipeline_stages(num_layers: int, num_stages: int, explicit: str | Sequence[int] | None = None
                    ) -> list[PipelineStage]:
    parts = layer_partition(num_layers, num_stages, explicit)
    starts = [sum(parts[:i]) for i in range(num_stages)]
    return [PipelineStage(i, num_stages, starts[i], starts[i] + parts[i]) for i in range(num_stages)]


# -- which part of a checkpoint tensor a rank holds ----------------------------------------------------

@dataclass(frozen=True)
class Split:
    """This rank's part of a checkpoint tensor: along `dim`, the range (start, size) of each fused shard, in the
    coordinates of that shard's own checkpoint tensor (`shard_sizes` are their full sizes, for a checkpoint that
    stores the shards fused, as Phi-3 does). `padded`: the parameter may be longer than the part (the last vocab
    range), the rest is zeros. `zero`: the rank holds zeros (a row-parallel bias is added by rank 0 alone)."""
    dim: int
    parts: tuple[tuple[int, int], ...]
    shard_sizes: tuple[int, ...]
    padded: bool = False
    zero: bool = False

    def take(self, tensor, shard: int | None) -> torch.Tensor:
        """This rank's part of `tensor` (a torch tensor, or a safetensors slice read here and no further)."""
        if self.zero:
            return torch.zeros(shape_of(tensor))
        if shard is not None:
            ranges = [self.parts[shard]]
        else:  # the whole (possibly fused) tensor: each shard's part at that shard's offset
            offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
            ranges = [(offset + start, size) for offset, (start, size) in zip(offsets, self.parts)]
        pieces = [read(tensor, self.dim, start, size) for start, size in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


def shape_of(tensor) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def read(tensor, dim: int, start: int, size: int) -> torch.Tensor:
    """`tensor.narrow(dim, start, size)`, reading only that range from the file for a safetensors slice."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, size)
    return tensor[(slice(None),) * dim + (slice(start, start + size),)]


def materialize(tensor) -> torch.Tensor:
    """A whole checkpoint tensor (replicated parameters: norms, ...)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


def even_part(size: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    if size % tp.size:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {tp.size}")
    part = size // tp.size
    return tp.rank * part, part


# -- the layers ------------------------------------------------------------------------------------------

def column_parallel(in_features: int, out_sizes: int | Sequence[int], bias: bool = False,
                    tp: TensorParallel | None = None,
                    parts: Sequence[tuple[int, int]] | None = None, padded: bool = False) -> Linear:
    """A `Linear` holding this rank's rows of each output shard: `parts` (start, size) per shard, default an
    even split. Its forward is the plain one: the outputs stay split."""
    tp = tp or current()
    sizes = [out_sizes] if isinstance(out_sizes, int) else list(out_sizes)
    if tp.size == 1:
        return Linear(in_features, sizes if len(sizes) > 1 else sizes[0], bias=bias)
    parts = list(parts) if parts is not None else [even_part(s, tp, "a projection's outputs") for s in sizes]
    local = [math.ceil(sizes[0] / tp.size)] if padded else [size for _, size in parts]  # padded: the vocab ranges
    layer = Linear(in_features, local if len(local) > 1 else local[0], bias=bias)
    split = Split(0, tuple(parts), tuple(sizes), padded=padded)
    layer.tp_splits = {"weight": split, "bias": split}
    return layer


class RowParallelLinear(Linear):
    """A `Linear` holding this rank's columns of W: its product is a partial sum, completed by an all-reduce.
    Only rank 0 adds the bias (the other ranks hold zeros), so it is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        start, size = even_part(in_features, tp, "a row-parallel projection's inputs")
        super().__init__(size, out_features, bias=bias)
        self.tp = tp
        self.tp_splits = {"weight": Split(1, ((start, size),), (in_features,)),
                          "bias": Split(0, ((0, out_features),), (out_features,), zero=tp.rank != 0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def row_parallel(in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel | None = None) -> Linear:
    tp = tp or current()
    return Linear(in_features, out_features, bias=bias) if tp.size == 1 else RowParallelLinear(
        in_features, out_features, bias, tp)


def vocab_part(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first id, ids held, rows allocated) of this rank's vocab range: ranges of ceil(V / size) rows, the
    last one padded."""
    rows = math.ceil(vocab_size / tp.size)
    start = tp.rank * rows
    return start, max(0, min(rows, vocab_size - start)), rows


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by rows: each rank looks up the ids in its range, zeros for the others, and an
    all-reduce sums the ranks' rows into the full embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, held, rows = vocab_part(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.tp_splits = {"weight": Split(0, ((self.start, held),), (vocab_size,), padded=True)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


def plain_embedding(num: int, dim: int) -> nn.Embedding:
    """An `nn.Embedding` left unfilled, as every layer is until the checkpoint fills it: its random init would be
    wasted, and nn.init's first call imports torch._dynamo (1.3 s of start-up)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def embedding(vocab_size: int, hidden_size: int, tp: TensorParallel | None = None) -> nn.Module:
    tp = tp or current()
    return plain_embedding(vocab_size, hidden_size) if tp.size == 1 else VocabParallelEmbedding(vocab_size,
                                                                                               hidden_size, tp)


def lm_head(hidden_size: int, vocab_size: int, tp: TensorParallel | None = None) -> Linear:
    """The logits projection, split by vocab ranges like the embedding (see `TensorParallel.gather_logits`)."""
    tp = tp or current()
    if tp.size == 1:
        return Linear(hidden_size, vocab_size)
    start, held, _ = vocab_part(vocab_size, tp)
    return column_parallel(hidden_size, vocab_size, tp=tp, parts=[(start, held)], padded=True)


@dataclass(frozen=True)
class HeadPart:
    """This rank's attention heads: query heads [q_start, q_start + num_q), KV heads [kv_start, kv_start + num_kv)."""
    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_part(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadPart:
    """Query heads split evenly; KV heads split with them, or, with fewer KV heads than ranks, the one KV head
    this rank's query heads share (replicated on the ranks that share it)."""
    check_heads(num_heads, num_kv_heads, tp.size)
    num_q = num_heads // tp.size
    q_start = tp.rank * num_q
    if num_kv_heads >= tp.size:
        num_kv = num_kv_heads // tp.size
        return HeadPart(q_start, num_q, tp.rank * num_kv, num_kv)
    group = num_heads // num_kv_heads  # query heads per KV head: a multiple of num_q here
    return HeadPart(q_start, num_q, q_start // group, 1)


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    if num_heads % size:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size {size}: one must divide "
                         "the other (KV heads are split across ranks, or replicated when there are fewer)")


def check_model(cls: type, config: dict, size: int, quantization=None) -> None:
    """Refuse, from config.json alone, a model this many ranks cannot split (a ValueError that says why)."""
    if size == 1:
        return
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"{cls.__name__} does not support tensor parallelism yet (tensor_parallel_size {size}); "
                         "the Llama-block families do: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2")
    if quantization is not None and quantization.method != "int8":
        raise ValueError(f"{quantization.method} checkpoints do not support tensor parallelism yet (their packed "
                         "int4 layouts are not split across ranks); int8 and unquantized weights are")
    args = cls.args_from_config(config)
    check_heads(args.num_heads, args.num_kv_heads, size)
    if args.intermediate_size % size:
        raise ValueError(f"intermediate_size ({args.intermediate_size}) is not divisible by tensor_parallel_size "
                         f"{size}")
