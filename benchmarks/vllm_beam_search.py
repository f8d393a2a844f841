"""vLLM's LLM.beam_search on the workload `aserve bench throughput --beam-width N` runs: random token-id prompts of
one length (the same generator and seed), N beams each decoding OUTPUT_LEN tokens with ignore_eos, the same
output-token count. Runs in vLLM's venv (benchmarks/setup_vllm_cpu.sh); imports nothing from aserve.
Usage: python vllm_beam_search.py MODEL_DIR NUM_PROMPTS INPUT_LEN OUTPUT_LEN BEAM_WIDTH DTYPE"""
import json
import random
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer
from vllm import LLM
from vllm.inputs import TokensPrompt
from vllm.sampling_params import BeamSearchParams


def main() -> None:
    model, num, input_len, output_len, width, dtype = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
    config = json.loads((Path(model) / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = config.get("eos_token_id")
    avoid = set(eos if isinstance(eos, list) else [eos] if eos is not None else []) | set(tokenizer.all_special_ids)
    rng = random.Random(0)  # aserve bench's --seed default
    allowed = [t for t in range(config["vocab_size"]) if t not in avoid]
    prompts = [[rng.choice(allowed) for _ in range(input_len)] for _ in range(num)]

    llm = LLM(model, dtype=dtype, max_model_len=input_len + output_len + 16)
    llm.beam_search([TokensPrompt(prompt_token_ids=prompts[0][:16])], BeamSearchParams(beam_width=width, max_tokens=4,
                                                                                       ignore_eos=True))
    start = time.perf_counter()
    llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    BeamSearchParams(beam_width=width, max_tokens=output_len, ignore_eos=True))
    elapsed = time.perf_counter() - start
    out = num * width * output_len
    print(f"Throughput: {num / elapsed:.2f} requests/s, {(num * input_len + out) / elapsed:.2f} total tokens/s, "
          f"{out / elapsed:.2f} output tokens/s", flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process, which imports this file
    main()
