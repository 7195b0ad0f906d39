"""Device check: greedy agreement of mmha decoding with the reference decoder over several seeds,
dtypes and eager/graph; prints one JSON line per run (used to pick the test thresholds)."""

import json
import sys

import torch

from mmha.models.generate import agree, random_prompts
from mmha.models.llama import PRESETS, TinyLlama


def main(seeds: int = 3, new_tokens: int = 256) -> None:
    for dtype in (torch.float16, torch.bfloat16):
        for seed in range(seeds):
            model = TinyLlama(PRESETS["small"], seed=seed).to("cuda", dtype).eval()
            prompts = random_prompts(4, [17, 100, 250, 31], model.cfg.vocab_size, seed=seed)
            for graph in (False, True):
                a = agree(model, prompts, new_tokens, graph=graph)
                print(json.dumps({"seed": seed, **a}), flush=True)
    try:
        from test_hf import PROMPT_LENGTHS, build, hf_greedy, prompts
    except ImportError as e:  # transformers missing
        print(f"hf: skipped ({e})")
        return
    from mmha.hf import HFDecoder

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for kind in ("llama", "qwen2"):
            model = build(kind, "cuda", dtype)
            ps = prompts(model.config.vocab_size)
            dec = HFDecoder(model, len(ps), max(PROMPT_LENGTHS) + 129)
            ours = dec.generate(ps, 128)
            same = []
            for p, a in zip(ps, ours, strict=True):
                b = hf_greedy(model, p, 128)
                same.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)))
            print(json.dumps({"hf": kind, "dtype": str(dtype), "tokens_identical_until": same}), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
