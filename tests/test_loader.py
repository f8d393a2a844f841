"""Loading from local Hugging Face folders: sharded checkpoints, dtypes, and errors that name the culprit."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import DEFAULT_MODEL_DIR, parse_memory
from aserve.models.loader import load_model
from conftest import load_reference, random_prompts, reference_greedy

PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(4, lengths=(5, 30), seed=11)]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def copy_model(model_dirs, tmp_path, family="llama-untied"):
    path = tmp_path / family
    shutil.copytree(model_dirs[family], path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def assert_weights_equal_checkpoint(model, checkpoint_dir, dtype):
    """Every parameter of a Llama-family model holds exactly the checkpoint's tensor cast to `dtype`; fused
    projections hold the checkpoint's separate ones stacked in order; no checkpoint tensor is left unused
    (a tied lm_head excepted)."""
    from safetensors.torch import load_file

    checkpoint = {}
    for file in sorted(checkpoint_dir.glob("*.safetensors")):
        checkpoint.update(load_file(file))
    used = set()
    params = dict(model.named_parameters())
    for name, param in params.items():
        fused = next((f for f in FUSED if f".{f}." in name), None)
        parts = [f"model.{name.replace(fused, piece)}" for piece in FUSED[fused]] if fused else \
            [name if name.startswith("lm_head.") else f"model.{name}"]
        expected = torch.cat([checkpoint[part] for part in parts]).to(dtype)
        assert param.dtype == dtype and torch.equal(param.data.cpu(), expected), name
        used.update(parts)
    assert set(checkpoint) - used <= {"lm_head.weight"} and ("lm_head.weight" in used) == ("lm_head.weight" in params)


def test_sharded_checkpoint_gives_the_same_output(model_dirs, tmp_path):
    import transformers

    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"]).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dirs["qwen3"] / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    a = LLM(str(model_dirs["qwen3"]), dtype="float32", kv_cache_memory="8MiB").generate(PROMPTS, GREEDY, use_tqdm=False)
    from_shards = LLM(str(sharded), dtype="float32", kv_cache_memory="8MiB")
    b = from_shards.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    one_file = load_model(model_dirs["qwen3"], dtype="float32").model.state_dict()
    shards = from_shards.engine.runner.model.state_dict()
    assert one_file.keys() == shards.keys() and all(torch.equal(one_file[k], shards[k].cpu()) for k in one_file)


@pytest.mark.parametrize("dtype, expected", [("auto", torch.float32), ("bfloat16", torch.bfloat16),
                                             ("float16", torch.float16), ("float32", torch.float32)])
def test_dtypes(model_dirs, dtype, expected):
    """The weights land in the asked dtype with the checkpoint's exact values (cast); in float32 the greedy
    tokens are transformers' own."""
    path = model_dirs["llama-gqa-tied"]
    llm = LLM(str(path), dtype=dtype, kv_cache_memory="8MiB")
    assert llm.engine.dtype == expected and llm.engine.runner.kv_cache.dtype == expected
    assert_weights_equal_checkpoint(llm.engine.runner.model, path, expected)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [len(o) for o in outs] == [12] * len(PROMPTS)
    if expected == torch.float32:
        prompts = [p["prompt_token_ids"] for p in PROMPTS]
        assert outs == reference_greedy(load_reference(path), prompts, max_new_tokens=12)


def test_missing_folder_and_files(model_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    path = copy_model(model_dirs, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(path)


def test_unsupported_architecture(model_dirs, tmp_path):
    path = copy_model(model_dirs, tmp_path)
    edit_config(path, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="config.json: architectures .*GPTNeoXForCausalLM.* not supported"):
        load_model(path)


def test_shape_mismatch_names_the_tensor(model_dirs, tmp_path):
    path = copy_model(model_dirs, tmp_path)
    edit_config(path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.(gate|up|down)_proj.weight' has shape \(64, 128\), the config implies \(64, 96\)|has shape \(128, 64\), the config implies \(96, 64\)"):
        load_model(path)


def test_missing_field_is_named(model_dirs, tmp_path):
    path = copy_model(model_dirs, tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["hidden_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'hidden_size'"):
        load_model(path)


def test_missing_weights_are_named(model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_model(model_dirs, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(path)


def test_memory_sizes():
    assert parse_memory("4GiB") == 4 * 1024 ** 3
    assert parse_memory("512MiB") == 512 * 1024 ** 2
    assert parse_memory("2GB") == 2 * 1000 ** 3
    assert parse_memory("1.5G") == int(1.5 * 1024 ** 3)
    assert parse_memory(12345) == 12345 and parse_memory("12345") == 12345
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory("lots")


def test_kv_budget_sets_block_count(model_dirs):
    llm = LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory="1MiB", block_size=8)
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, 8 tokens, 2 kv heads, head_dim 16, fp32
    assert llm.engine.kv.num_blocks == (1024 * 1024) // per_block
    with pytest.raises(ValueError, match="smaller than one KV block"):
        LLM(str(model_dirs["llama-gqa-tied"]), dtype="float32", kv_cache_memory=100)


def test_embedded_default_model_loads():
    """LLM() with no model loads the embedded checkpoint exactly, with its eos id and tokenizer; its first
    greedy token is transformers' (a margin of 1.5 logits, so it holds in any dtype auto picks)."""
    llm = LLM(kv_cache_memory="16MiB")
    assert_weights_equal_checkpoint(llm.engine.runner.model, DEFAULT_MODEL_DIR, llm.engine.dtype)
    assert llm.engine.eos_token_ids == frozenset({0})
    out = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    assert out.prompt_token_ids == tokenizer.encode("def main():")
    generated = out.outputs[0]
    assert len(generated.token_ids) == 8 and generated.finish_reason == "length"
    assert generated.text == tokenizer.decode(generated.token_ids, skip_special_tokens=True)
    with torch.no_grad():
        logits = load_reference(DEFAULT_MODEL_DIR)(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    assert generated.token_ids[0] == int(logits.argmax())


def test_tokenizer_loads_without_autoconfig_and_without_a_named_class(tmp_path):
    """The tokenizer of a folder whose tokenizer_config.json names its class loads without AutoConfig (whose model
    configs import torch._dynamo, seconds of start-up); a folder that names none still gets the class its config
    maps to, and both encode alike."""
    import subprocess
    import sys

    from aserve.models.loader import load_tokenizer

    probe = ("import sys; from aserve.models.loader import load_tokenizer; "
             f"load_tokenizer({str(DEFAULT_MODEL_DIR)!r}); print('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip() == "False"

    unnamed = tmp_path / "unnamed"
    shutil.copytree(DEFAULT_MODEL_DIR, unnamed, ignore=shutil.ignore_patterns("*.safetensors"))
    settings = json.loads((unnamed / "tokenizer_config.json").read_text())
    del settings["tokenizer_class"]
    (unnamed / "tokenizer_config.json").write_text(json.dumps(settings))
    text = "Paged attention, continuous batching: 42 tokens!"
    assert load_tokenizer(unnamed).encode(text) == load_tokenizer(DEFAULT_MODEL_DIR).encode(text)


def test_weights_move_into_one_mapping_for_huge_pages(monkeypatch):
    """weights_in_huge_pages copies a module's tensors (parameters, buffers, tensors in attributes and in tuples or
    dicts of them) into one mapping, in module order, each storage once: values unchanged, views of one storage
    still views of one copy, a tied parameter moved once; ASERVE_HUGE_PAGE_WEIGHTS=0 moves nothing."""
    from typing import NamedTuple

    from aserve.models import weight_pages

    class Packed(NamedTuple):
        tensor: torch.Tensor
        rows: int

    def build():
        torch.manual_seed(0)
        inner = torch.nn.Linear(8, 5)
        outer = torch.nn.Module()
        outer.inner, outer.head = inner, torch.nn.Linear(8, 5, bias=False)
        outer.head.weight = inner.weight  # tied
        outer.register_buffer("table", torch.arange(7, dtype=torch.float64))
        outer.packed = Packed(torch.randn(3, 4).bfloat16(), 3)
        outer.tail = inner.weight.detach()[2:]  # a view into the tied weight's storage
        with torch.inference_mode():  # an inference tensor moves too
            outer.extra = {"ids": torch.arange(6, dtype=torch.int32)}
        return outer

    monkeypatch.setattr(weight_pages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setenv("ASERVE_HUGE_PAGE_WEIGHTS", "0")
    kept = build()
    ptrs = [t.data_ptr() for t in weight_pages.module_tensors(kept)]
    assert weight_pages.weights_in_huge_pages(kept) == 0 and ptrs == [t.data_ptr() for t in weight_pages.module_tensors(kept)]
    monkeypatch.delenv("ASERVE_HUGE_PAGE_WEIGHTS")
    model, expected = build(), build()
    moved = weight_pages.weights_in_huge_pages(model)
    tensors = weight_pages.module_tensors(model)
    assert len(tensors) == 6  # inner.weight (= head.weight), inner.bias, table, packed.tensor, tail, extra["ids"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weight_pages.module_tensors(expected)}
    assert len(storages) == 5 and moved == sum(-(-n // 64) * 64 for n in storages.values())
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one mapping holds them all
    assert all(t.data_ptr() % 64 == 0 for t in tensors if t is not model.tail)
    for got, want in zip(tensors, weight_pages.module_tensors(expected)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert model.head.weight is model.inner.weight and isinstance(model.inner.weight, torch.nn.Parameter)
    assert model.tail.data_ptr() == model.inner.weight.data_ptr() + 2 * 8 * 4
    with torch.no_grad():
        model.inner.weight[3, 0] = 42.0
    assert model.tail[1, 0] == 42.0  # still a view of the moved weight
    x = torch.randn(2, 8)
    expected.inner.weight.data[3, 0] = 42.0
    assert torch.equal(model.inner(x), expected.inner(x))


def test_a_loaded_model_decodes_the_same_from_huge_pages(model_dirs, monkeypatch):
    """load_model puts a CPU model's weights in one mapping advised for 2 MiB pages where the kernel has them;
    greedy tokens are those of the model left where loading put it."""
    from aserve.models import weight_pages

    if weight_pages.transparent_huge_pages() in (None, "never"):
        pytest.skip("no transparent huge pages on this machine")
    moved = LLM(model=str(model_dirs["llama-gqa-tied"]), dtype="float32")
    tensors = weight_pages.module_tensors(moved.engine.executor.worker.runner.model)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    monkeypatch.setenv("ASERVE_HUGE_PAGE_WEIGHTS", "0")
    plain = LLM(model=str(model_dirs["llama-gqa-tied"]), dtype="float32")
    assert len({t.untyped_storage().data_ptr()
                for t in weight_pages.module_tensors(plain.engine.executor.worker.runner.model)}) > 1
    got, want = (llm.generate(PROMPTS, GREEDY, use_tqdm=False) for llm in (moved, plain))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
