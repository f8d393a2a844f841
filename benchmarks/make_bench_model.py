#!/usr/bin/env python3
"""Write the benchmark model: a SmolLM2-135M-shaped Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, vocab 49152)
with random bf16 weights and a small byte-level BPE tokenizer; with --bert, the embedding benchmark's model
instead: a BERT-base-shaped encoder (hidden 768, 12 layers, 12 heads, vocab 30522) with a WordPiece tokenizer,
saved as a sentence-transformers folder (mean pooling, normalized), as most BERT-based embedders ship.

With --draft-from DIR: a draft model for speculative decoding instead: DIR's model cut to its first --layers layers
(default 3), with DIR's tokenizer and final norm: an early-exit copy that agrees with DIR where its first layers
already decide the next token.

With --damp-after N: the bench model with the output projections (o_proj, down_proj) of its layers from N on
scaled by --damp-factor (default 0.3): the same shape and cost, but its first N layers already decide most tokens,
so that a draft of those N layers (--draft-from) agrees with it as a good draft agrees with its target: a pair to
measure speculative decoding's machinery at a realistic acceptance rate (random weights have no real draft).

Usage: python benchmarks/make_bench_model.py OUT_DIR [--bert] [--layers N] [--seed S] [--corpus-bytes B]
                                             [--heads H --kv-heads K] [--damp-after N [--damp-factor F]]
       python benchmarks/make_bench_model.py OUT_DIR --draft-from BENCH_MODEL_DIR [--layers N]

Random weights measure speed as well as trained ones do: run them with ignore_eos and fixed lengths, as vLLM's own
benchmarks do. The tokenizer is trained on this Python's standard library sources, so nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sysconfig


def stdlib_sources(limit_bytes: int):
    """Python sources of the standard library, up to about `limit_bytes` of text: the tokenizer's corpus."""
    total = 0
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(errors="ignore")
        total += len(text)
        yield text
        if total > limit_bytes:
            return


def train_tokenizer(corpus_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_sources(corpus_bytes), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def train_wordpiece(corpus_bytes: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(stdlib_sources(corpus_bytes), trainers.WordPieceTrainer(vocab_size=30522,
                                                                                    special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return BertTokenizerFast(tokenizer_object=tok)


def write_bert(args) -> None:
    """BERT-base's shape, random weights, as a sentence-transformers folder (Transformer, mean Pooling, Normalize)."""
    import torch
    from transformers import BertConfig, BertModel

    out = pathlib.Path(args.out)
    config = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=args.layers or 12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512, pad_token_id=0)
    torch.manual_seed(args.seed)
    BertModel(config, add_pooling_layer=False).to(torch.bfloat16).save_pretrained(out)
    train_wordpiece(args.corpus_bytes).save_pretrained(out)
    modules = [("", "sentence_transformers.models.Transformer"), ("1_Pooling", "sentence_transformers.models.Pooling"),
               ("2_Normalize", "sentence_transformers.models.Normalize")]
    (out / "modules.json").write_text(json.dumps([{"idx": i, "name": str(i), "path": path, "type": kind}
                                                  for i, (path, kind) in enumerate(modules)], indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    for folder in ("1_Pooling", "2_Normalize"):
        (out / folder).mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 768,
                                                               "pooling_mode_mean_tokens": True}))
    print(f"wrote {out}: a BERT-base-shaped sentence-transformers embedder")


def write_draft(args) -> None:
    """The first --layers layers of --draft-from's model, everything else as it is there."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    src, out, keep = pathlib.Path(args.draft_from), pathlib.Path(args.out), args.layers or 3
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(f).items():
            layer = re.search(r"\.layers\.(\d+)\.", name)
            if layer is None or int(layer.group(1)) < keep:
                weights[name] = tensor
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    for index in out.glob("*.safetensors.index.json"):
        index.unlink()
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = keep
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {out}: the first {keep} layers of {src}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the folder to write (Hugging Face format)")
    ap.add_argument("--bert", action="store_true", help="the BERT-base-shaped embedder (aserve bench embed) instead")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers (default 30, SmolLM2-135M's; with --bert 12, BERT-base's)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--corpus-bytes", type=int, default=4_000_000, help="how much stdlib source trains the tokenizer")
    ap.add_argument("--heads", type=int, default=9, help="attention heads (default 9, SmolLM2's); --heads 12 "
                    "--kv-heads 4 keeps the weights and FLOPs and splits over 2 tensor-parallel ranks")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--damp-after", type=int, default=None, help="scale the output projections of layers from here on")
    ap.add_argument("--damp-factor", type=float, default=0.3)
    ap.add_argument("--draft-from", default=None, help="write a draft model: this folder's model, first --layers kept")
    args = ap.parse_args()
    if args.bert:
        return write_bert(args)
    if args.draft_from:
        return write_draft(args)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(args.corpus_bytes)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers or 30,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=576 // args.heads,
                         vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if args.damp_after is not None:
        with torch.no_grad():
            for layer in model.model.layers[args.damp_after:]:
                layer.self_attn.o_proj.weight.mul_(args.damp_factor)
                layer.mlp.down_proj.weight.mul_(args.damp_factor)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)

    # Older readers (the transformers release vLLM pins among them) look for rope_theta at the top level.
    path = pathlib.Path(args.out) / "config.json"
    saved = json.loads(path.read_text())
    saved.setdefault("rope_theta", 10000.0)
    saved["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(saved, indent=2))
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
