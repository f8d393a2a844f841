"""`aserve bench quality`: what a lossy option costs in quality, measured against the same model unquantized in fp32.

The candidate is the engine the flags describe (`--quantization int8`, `--kv-cache-dtype fp8`, `--dtype bfloat16`,
...); the reference is the same model with every option in CANDIDATE_ONLY reset and dtype float32. A lossy option
added later joins CANDIDATE_ONLY and is measured the same way. For `--quantization gptq|awq` on a 16/32-bit model the
tool first writes a round-to-nearest 4-bit copy in that format (aserve.bench.quantize_rtn; `--rtn-lm-head`: its LM
head too) and loads it.

Three figures, all from the engine's own outputs:
- perplexity of both on a held-out text (windows of `--window` tokens, every token after the first scored);
- mean KL(reference || candidate) of the next-token distributions over those same positions (full vocabulary:
  the tool records the logits the engine computes for `prompt_logprobs`);
- greedy agreement: `--num-prompts` slices of the text continued greedily for `--max-tokens` tokens by both; the
  share identical token for token, and the mean number of tokens before the first difference.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from aserve.config import DEFAULT_MODEL_DIR, add_engine_arguments, engine_options

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "shakespeare_validation.txt"  # held out from training
# option -> its value for the reference (an option this engine lacks is skipped)
CANDIDATE_ONLY = {"quantization": None, "quantize_lm_head": False, "kv_cache_dtype": "auto",
                  "calculate_kv_scales": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", default=str(TEXT), help="held-out text to score (default: the embedded model's "
                                                          "held-out Shakespeare passage)")
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--group-size", type=int, default=None,
                        help="gptq/awq on a 16/32-bit model: the group size of the round-to-nearest copy "
                             "(default: the largest of 128, 64, 32 that divides the layers' inputs)")
    parser.add_argument("--rtn-lm-head", action="store_true",
                        help="gptq on a 16/32-bit model: the round-to-nearest copy quantizes the LM head to int4 "
                             "too (as GPTQModel's lm_head=True)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures here")
    add_engine_arguments(parser, defaults={"dtype": "float32", "kv_cache_memory": "256MiB",
                                           "enable_prefix_caching": False})


class LogitsRecorder:
    """Keeps what the engine's model returns from compute_logits, as fp32 log-probabilities, in call order."""

    def __init__(self, llm):
        model = llm.engine.runner.model
        self.inner, self.calls = model.compute_logits, []
        model.compute_logits = self

    def __call__(self, hidden):
        logits = self.inner(hidden)
        self.calls.append(logits.float().log_softmax(-1).cpu())
        return logits

    def window(self, llm, tokens: list[int]):
        """The next-token log-probabilities at every position of `tokens` ([len(tokens), vocab])."""
        import torch

        from aserve import SamplingParams

        self.calls.clear()
        llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        rows = torch.cat(self.calls)  # the prompt's positions (in chunks, in order), then the sampled one
        if rows.shape[0] != len(tokens):
            raise RuntimeError(f"expected {len(tokens)} rows of logits from the engine, got {rows.shape[0]}")
        return rows


def measure(reference, candidate, tokens: list[int], window: int, prompts: list[list[int]], max_tokens: int) -> dict:
    import torch

    from aserve import SamplingParams

    ref_rec, cand_rec = LogitsRecorder(reference), LogitsRecorder(candidate)
    nll_ref = nll_cand = kl = 0.0
    positions = 0
    for start in range(0, len(tokens) - window + 1, window):
        w = tokens[start:start + window]
        ref, cand = ref_rec.window(reference, w)[:-1], cand_rec.window(candidate, w)[:-1]
        target = torch.tensor(w[1:]).unsqueeze(1)
        nll_ref -= ref.gather(1, target).sum().item()
        nll_cand -= cand.gather(1, target).sum().item()
        kl += (ref.exp() * (ref - cand)).sum().item()
        positions += len(w) - 1
    if not positions:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one window of {window}")
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                           use_tqdm=False)] for llm in (reference, candidate)]
    same_prefix = [next((i for i, (a, b) in enumerate(zip(r, c)) if a != b), len(r)) for r, c in zip(*outs)]
    return {"positions": positions, "perplexity_reference": math.exp(nll_ref / positions),
            "perplexity": math.exp(nll_cand / positions), "mean_kl": kl / positions,
            "greedy_identical": sum(r == c for r, c in zip(*outs)) / len(prompts),
            "greedy_tokens_before_difference": sum(same_prefix) / len(prompts), "num_prompts": len(prompts),
            "max_tokens": max_tokens}


def spread_prompts(tokens: list[int], count: int, length: int) -> list[list[int]]:
    """`count` slices of `length` tokens at evenly spaced offsets of the text."""
    last = len(tokens) - length
    if last < 0:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one prompt of {length}")
    return [tokens[round(i * last / max(count - 1, 1)):][:length] for i in range(count)]


def main(args: argparse.Namespace) -> None:
    from aserve import LLM
    from aserve.models.registry import read_config
    from aserve.bench.quantize_rtn import write_rtn_checkpoint

    candidate_options = engine_options(args)
    reset = {k: v for k, v in CANDIDATE_ONLY.items() if k in candidate_options}
    reference_options = {**candidate_options, **reset, "dtype": "float32"}
    model = candidate_options["model"] or str(DEFAULT_MODEL_DIR)
    label = ", ".join(f"{k}={candidate_options[k]}" for k in (*reset, "dtype")
                      if k == "dtype" or candidate_options[k] != reference_options[k])
    with tempfile.TemporaryDirectory(prefix="aserve-rtn-") as scratch:
        method = candidate_options["quantization"]
        if method in ("gptq", "awq") and not read_config(model).get("quantization_config"):
            group = write_rtn_checkpoint(model, scratch, method, args.group_size, args.rtn_lm_head)
            candidate_options.update(model=scratch, quantization=None)
            head = ", LM head included" if args.rtn_lm_head else ""
            label += f" (round-to-nearest copy, group size {group}{head})"
        reference = LLM(**reference_options)
        candidate = LLM(**candidate_options)
        tokens = reference.get_tokenizer().encode(Path(args.text).read_text())
        prompts = spread_prompts(tokens, args.num_prompts, args.prompt_len)
        figures = measure(reference, candidate, tokens, args.window, prompts, args.max_tokens)
    figures.update(model=model, candidate=label or "the reference options")
    print(f"aserve bench quality: {model}, candidate {figures['candidate']} against fp32 unquantized")
    print(f"perplexity        {figures['perplexity']:.4f} (reference {figures['perplexity_reference']:.4f}, "
          f"{figures['positions']} positions)")
    print(f"mean KL           {figures['mean_kl']:.6f} nats per token")
    print(f"greedy agreement  {figures['greedy_identical']:.1%} of {figures['num_prompts']} prompts identical over "
          f"{figures['max_tokens']} tokens; {figures['greedy_tokens_before_difference']:.1f} tokens before the first "
          "difference on average")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
