#!/usr/bin/env python3
"""PyTorch CPU throughput of the default embedding model, for comparison with the worker.

Run by scripts/bench-models (in a venv with sentence-transformers); prints one JSON object per
batch size: {"runtime": "pytorch", "batch": B, "sentences_per_second": S}.
"""

import argparse
import json
import os
import time

import torch
from sentence_transformers import SentenceTransformer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=os.environ.get("NOMAD_MODELS_DIR", "models"))
    parser.add_argument("--sentences", default="scripts/reference/bench_sentences.txt")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sentences = [s for s in open(args.sentences).read().splitlines() if s]
    model = SentenceTransformer(os.path.join(args.models, "all-minilm-l6-v2"), device="cpu")
    batches = [sentences[i : i + args.batch] for i in range(0, len(sentences), args.batch)]
    batches = [b for b in batches if len(b) == args.batch] or [sentences[: args.batch]]
    with torch.inference_mode():
        for b in batches[:3]:  # warm-up
            model.encode(b, batch_size=args.batch, normalize_embeddings=True)
        done, i, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            model.encode(batches[i % len(batches)], batch_size=args.batch, normalize_embeddings=True)
            done += args.batch
            i += 1
        elapsed = time.perf_counter() - started
    print(json.dumps({"runtime": "pytorch", "batch": args.batch, "sentences_per_second": done / elapsed}))


if __name__ == "__main__":
    main()
