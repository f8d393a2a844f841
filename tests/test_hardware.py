"""dtype=auto follows the hardware: a 16-bit checkpoint runs in 16 bits only where the CPU does that natively."""
from __future__ import annotations

import logging

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve import hardware
from aserve.hardware import CpuInfo, cpu_info, resolve_dtype

AVX2 = CpuInfo("AVX2", native_bf16=False, native_fp16=False, threads=2)
AVX512_BF16 = CpuInfo("AVX512", native_bf16=True, native_fp16=False, threads=2)
AMX_FP16 = CpuInfo("AVX512", native_bf16=True, native_fp16=True, threads=2)
CPU = torch.device("cpu")


@pytest.mark.parametrize("info, checkpoint, expected", [
    (AVX2, "bfloat16", torch.float32), (AVX2, "float16", torch.float32), (AVX2, "float32", torch.float32),
    (AVX512_BF16, "bfloat16", torch.bfloat16), (AVX512_BF16, "float16", torch.bfloat16),
    (AVX512_BF16, "float32", torch.float32), (AMX_FP16, "float16", torch.float16),
])
def test_auto_keeps_16_bits_only_where_native(info, checkpoint, expected):
    dtype, reason = resolve_dtype("auto", {"torch_dtype": checkpoint}, CPU, info)
    assert dtype == expected
    assert reason.startswith("auto: ") and info.capability in reason
    if expected == torch.float32 and checkpoint != "float32":
        assert f"no native {checkpoint}" in reason


def test_the_config_field_names_and_a_missing_dtype():
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, CPU, AVX512_BF16)[0] == torch.bfloat16  # transformers 5
    assert resolve_dtype("auto", {}, CPU, AVX512_BF16)[0] == torch.float32


def test_an_explicit_emulated_dtype_is_honoured_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(hardware, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="aserve"):
        for _ in range(3):
            assert resolve_dtype("bfloat16", {"torch_dtype": "float32"}, CPU, AVX2)[0] == torch.bfloat16
    warnings = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warnings) == 1 and "AVX2" in warnings[0] and "float32" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aserve"):
        assert resolve_dtype("bfloat16", {}, CPU, AVX512_BF16)[0] == torch.bfloat16
    assert not caplog.records  # native: nothing to warn about


def test_the_probe_agrees_with_torch():
    info = cpu_info()
    assert info.capability == torch.backends.cpu.get_cpu_capability() and info.threads == torch.get_num_threads()
    if info.native_bf16:
        assert torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert info.capability in info.describe() and "threads" in info.describe()


def test_the_engine_logs_its_choice_and_runs_it(caplog):
    """The embedded model's checkpoint is bf16: on this machine auto gives bf16 only if the CPU has it."""
    with caplog.at_level(logging.INFO, logger="aserve"):
        llm = LLM(kv_cache_memory="16MiB")
    expected = torch.bfloat16 if cpu_info().native_bf16 else torch.float32
    assert llm.engine.dtype == expected and llm.engine.runner.kv_cache.dtype == expected
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype "))
    assert line.startswith(f"dtype {str(expected)[6:]} (auto: ") and cpu_info().capability in line
    assert len(llm.generate("ROMEO:", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4
