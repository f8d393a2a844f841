"""The sampler runs on the logits' device: what crosses to the host is the sampled token ids and the logprobs
asked for, never a row of logits, and the grammar bitmask goes to the logits rather than the logits to it.

There is no GPU here, so the tests stand one in: `FakeDevice` keeps the data on the CPU while the logits, and
every tensor computed from them or made with `device=logits.device`, say they live on "cuda". Like CUDA, it
refuses an op that mixes such a tensor with a host tensor (0-dim scalars and index tensors aside), and it
records each tensor that is brought back to the host (tolist, item, bool, cpu, ...). The sampler's results on
the stand-in must equal its results on the CPU, transfer for transfer small.
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from aserve.sampling_params import SamplingParams
from aserve.structured_output import bitmask as bitmask_module
from aserve.worker import sampler
from aserve.worker.request_state import RequestState

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")
T = torch.Tensor
DOWNLOADS = {T.tolist, T.item, T.cpu, T.numpy, T.__bool__, T.__int__, T.__float__, T.__index__}


class OnDevice(torch.Tensor):
    """Host data that says it lives on the stand-in GPU (see FakeDevice, which gives ops on it their results)."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:
        return GPU

    @property
    def is_cpu(self) -> bool:
        return False


def on_device(t: torch.Tensor) -> bool:
    return isinstance(t, OnDevice)


def names(arg, device_type: str) -> bool:
    """Whether an op's argument names a device of this type ("cuda" is the stand-in)."""
    return (isinstance(arg, torch.device) and arg.type == device_type) or (isinstance(arg, str) and arg == device_type)


class FakeDevice(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.downloads: list[tuple[str, tuple[int, ...]]] = []  # (what, shape) of each tensor brought to the host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DOWNLOADS and on_device(args[0]):
            self.downloads.append((func.__name__, tuple(args[0].shape)))
            return func(args[0].as_subclass(torch.Tensor), *args[1:], **kwargs)
        if func is T.to and on_device(args[0]) and any(names(a, "cpu") for a in tree_leaves((args[1:], kwargs))):
            self.downloads.append(("to", tuple(args[0].shape)))
            return args[0].as_subclass(torch.Tensor).to(*args[1:], **kwargs)
        asked_for_gpu = any(names(a, "cuda") for a in tree_leaves((args, kwargs)))  # a factory, or .to(device)
        args, kwargs = tree_map(lambda a: CPU if names(a, "cuda") else a, (args, kwargs))
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        checked = ([args[0], *args[2:]] if func is T.__setitem__ else [args[0]] if func is T.__getitem__
                   else [] if func in (T.to, T.copy_) else tensors)  # as on CUDA: indices may live on the host
        if any(on_device(t) for t in checked if isinstance(t, torch.Tensor)):
            host = [tuple(t.shape) for t in checked if isinstance(t, torch.Tensor) and not on_device(t) and t.dim()]
            if host:
                raise RuntimeError(f"{getattr(func, '__name__', func)} mixes the device with host tensors {host}")
        out = func(*args, **kwargs)
        if asked_for_gpu or any(map(on_device, tensors)):
            out = tree_map(lambda o: o.as_subclass(OnDevice) if type(o) is torch.Tensor else o, out)
        return out


VOCAB = 300
ROWS = [  # one row of each kind of work the sampler does
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, logprobs=3),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=5, logprobs=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.3, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[7], eos_token_ids=frozenset({1}), logprobs=2),
]


def requests() -> list[RequestState]:
    reqs = []
    for i, params in enumerate(ROWS):
        req = RequestState(f"r{i}", [3, 5, 7, 11, i + 20], params)
        for token in (7, 9, 7):
            req.append_token(token)
        reqs.append(req)
    return reqs


def logits_for_test(bad_row: int | None = None) -> torch.Tensor:
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits[5, [1, 7]] = 10.0  # min_tokens must hold these back
    if bad_row is not None:
        logits[bad_row, 4] = float("nan")
    return logits


def run(logits: torch.Tensor) -> list[sampler.SampleResult]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return sampler.sample(logits, requests())


@pytest.mark.parametrize("bad_row", [None, 3])
def test_the_sampler_on_a_device_brings_back_only_its_results(monkeypatch, bad_row):
    monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *tensors: False)  # one draw path for both runs
    on_host = run(logits_for_test(bad_row))
    device = FakeDevice()
    with device:
        on_gpu = run(logits_for_test(bad_row).as_subclass(OnDevice))
    assert on_gpu == on_host
    assert (on_host[bad_row].error is not None) if bad_row is not None else all(r.error is None for r in on_host)
    assert all(len(shape) <= 2 and (not shape or shape[-1] < VOCAB) for _, shape in device.downloads), device.downloads
    assert ("tolist", (len(ROWS),)) in device.downloads  # the token ids, in one transfer
    # Whole small tensors in one transfer each (token ids, logprobs, ranks, top-k), and 0-dim flags ("is any row
    # unusable / emptied?"): never a transfer per row.
    assert all(what == "tolist" or (what == "__bool__" and shape == ()) for what, shape in device.downloads), \
        device.downloads
    assert len(device.downloads) <= 9, device.downloads


def test_on_the_cpu_the_draw_still_takes_the_cpu_kernel(monkeypatch):
    """The device-agnostic code leaves the CPU path as it was: the uniforms stay where they are drawn and the
    inverse-CDF draw is aserve's CPU kernel, not the torch path a GPU takes; so are the finite-logits check
    before it, the penalized rows' penalties, the greedy rows' argmax and the filtered rows' top-k, top-p and
    min-p."""
    if not sampler.cpu_kernels.available():
        pytest.skip("aserve's CPU kernels are not built here")
    asked = []
    usable = sampler.cpu_kernels.usable
    monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *tensors: asked.append(usable(*tensors)) or asked[-1])
    with torch.inference_mode():  # as the model runner calls it
        assert len(run(logits_for_test())) == len(ROWS)
    assert asked == [True] * 5  # the check, the penalties, the argmax, the filter, one draw: all on the kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_rows_take_one_kernel_and_give_what_the_full_path_gives(monkeypatch, dtype):
    """A batch whose rows are all plain greedy (no logprobs, penalties, bias or min_tokens) takes greedy_rows alone:
    the tokens and the unusable rows' errors of the full path, which a row that is not plain sends the batch to."""
    if not sampler.cpu_kernels.available():
        pytest.skip("aserve's CPU kernels are not built here")
    reqs = [RequestState(f"g{i}", [3, 5, i + 20], SamplingParams(temperature=0)) for i in range(4)]
    logits = (torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    logits[1, 9] = float("nan")
    logits[3, :] = float("-inf")
    with torch.inference_mode():
        plain = RequestState("lp", [3], SamplingParams(temperature=0, logprobs=1))
        full = sampler.sample(logits.clone(), reqs + [plain])  # (it zeroes unusable fp32 rows in place)
        asked = []
        usable = sampler.cpu_kernels.usable
        monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda *t: asked.append(usable(*t)) or asked[-1])
        fast = sampler.sample(logits[:4].clone(), reqs)
    assert asked == [True]  # one kernel call for the batch
    assert [(r.token_id, r.error) for r in fast] == [(0 if r.error else r.token_id, r.error) for r in full[:4]]
    assert [r.error is not None for r in fast] == [False, True, False, True]
    assert fast[0].token_id == int(logits[0].float().argmax())


def test_the_grammar_bitmask_is_uploaded_to_the_logits(monkeypatch):
    applied = []

    def apply_token_bitmask_inplace(logits, bitmask, vocab_size, indices):
        applied.append((logits, bitmask.device, bitmask.dtype, tuple(bitmask.shape), vocab_size, indices))

    xgrammar = pytest.importorskip("xgrammar")
    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", apply_token_bitmask_inplace)
    words = -(-VOCAB // 32)
    mask = torch.zeros(2, words, dtype=torch.int32)
    device = FakeDevice()
    with device:
        logits = logits_for_test().as_subclass(OnDevice)
        bitmask_module.apply_grammar_bitmask(logits, [f"r{i}" for i in range(len(ROWS))], ["r4", "r1"],
                                             mask.numpy().tobytes())
    [(target, where, dtype, shape, vocab, rows)] = applied
    assert target is logits and where == GPU and dtype == torch.int32 and shape == (len(ROWS), words)
    assert vocab == VOCAB and rows == [1, 4]
    assert device.downloads == []
