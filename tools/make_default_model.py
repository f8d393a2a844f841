#!/usr/bin/env python3
"""Write aserve's embedded default model: a tiny Llama with random bf16 weights and a small byte-level BPE tokenizer.

Usage: python tools/make_default_model.py [OUT_DIR]      (default: aserve/default_model in this repository)

Why random weights: the default model exists so that a fresh install can serve requests end to end with no download
(DESIGN.md section 4). For now its weights are random (seeded, so the folder is reproducible); a later issue replaces
them with a trained model of the same shape. The tokenizer is trained on this Python's standard-library sources in
sorted file order, so nothing is downloaded and every run gives the same vocabulary.

The folder holds config.json, generation_config.json, model.safetensors, tokenizer.json and tokenizer_config.json
(with the chat template inside it), and special_tokens_map.json where transformers writes one: about 8 MB in all.
"""
import json
import pathlib
import sys
import sysconfig

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "aserve" / "default_model"

SEED = 0
VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
KEEP = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json"}

# Plain text: each message is "role:\n<content><|endoftext|>\n"; the generation prompt is "assistant:\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ':\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
)


def corpus(limit_chars=3_000_000):
    """The standard library's .py sources, in sorted order, until about limit_chars characters."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="ignore")
        total += len(text)
        yield text
        if total > limit_chars:
            return


def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS,
                                     model_max_length=2048, clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def main(argv):
    if len(argv) > 1:
        sys.exit(__doc__)
    out = pathlib.Path(argv[0]) if argv else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)

    hf_tok = build_tokenizer()
    eos_id = hf_tok.convert_tokens_to_ids(EOS)
    assert eos_id == 0, f"{EOS} has id {eos_id}, expected 0"
    assert len(hf_tok) == VOCAB_SIZE, len(hf_tok)

    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB_SIZE, tie_word_embeddings=True,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=eos_id, eos_token_id=eos_id,
                      pad_token_id=eos_id)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)  # written explicitly, whatever save_pretrained decides
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (no chat_template.jinja).
    hf_tok.save_pretrained(out, save_jinja_files=False)

    # Older readers look for rope_theta at the top level; state the dtype there too (as the bench script does).
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.setdefault("rope_theta", 10000.0)
    config["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(config, indent=2) + "\n")

    # transformers 5 names the class "TokenizersBackend", which 4.x does not know; the old name loads in both.
    path = out / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(tok_config, indent=2) + "\n")

    for extra in sorted(out.iterdir()):
        if extra.name not in KEEP:
            if extra.is_dir():
                raise SystemExit(f"unexpected folder {extra}; remove it by hand")
            extra.unlink()
        else:
            extra.chmod(0o644)  # safetensors writes 0600; package data should be world-readable

    total = sum(p.stat().st_size for p in out.iterdir())
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {params / 1e6:.2f}M parameters, {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main(sys.argv[1:])
