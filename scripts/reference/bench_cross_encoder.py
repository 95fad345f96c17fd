#!/usr/bin/env python3
"""PyTorch CPU throughput of cross-encoders, for comparison with the worker's `rerank` and
`classify` on the same model directories.

    bench_cross_encoder.py make OUT MINILM_DIR
        writes OUT/rerank and OUT/classify: BERT sequence classifiers with all-MiniLM-L6-v2's
        encoder weights and a seeded random head (one label; two labels with names), the shape of
        the common MiniLM-L6 rerankers, saved by transformers.
    bench_cross_encoder.py run --kind rerank|classify --dir DIR --batch B [--seconds S]
        rerank: sentence-transformers' CrossEncoder scores one query against B sentences per
        call; classify: transformers labels B sentences per call (softmax). Prints
        {"runtime": "pytorch", "what", "batch", "texts_per_second"}.

Run by scripts/bench-cross-encoders in a venv with sentence-transformers (not in CI).
"""

import argparse
import json
import sys
import time

import torch

QUERY = "Which of these sentences answers the question best?"


def make(out, minilm):
    from transformers import AutoTokenizer, BertForSequenceClassification, BertModel

    encoder = BertModel.from_pretrained(minilm)
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    for name, labels in [("rerank", ["relevance"]), ("classify", ["negative", "positive"])]:
        torch.manual_seed(7)
        config = encoder.config
        config.num_labels = len(labels)
        config.id2label = dict(enumerate(labels))
        config.label2id = {label: i for i, label in enumerate(labels)}
        model = BertForSequenceClassification(config)
        model.bert.load_state_dict(encoder.state_dict())
        model.save_pretrained(f"{out}/{name}", safe_serialization=True)
        tokenizer.save_pretrained(f"{out}/{name}")


def run(args):
    torch.set_num_threads(args.threads)
    sentences = [s for s in open(args.sentences).read().splitlines() if s]
    calls = [sentences[i : i + args.batch] for i in range(0, len(sentences), args.batch)]
    calls = [c for c in calls if len(c) == args.batch]
    if args.kind == "rerank":
        from sentence_transformers import CrossEncoder

        model = CrossEncoder(args.dir, device="cpu")
        score = lambda chunk: model.predict([(QUERY, s) for s in chunk], batch_size=args.batch)
    else:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.dir)
        model = AutoModelForSequenceClassification.from_pretrained(args.dir).eval()

        def score(chunk):
            batch = tokenizer(chunk, padding=True, truncation=True, return_tensors="pt")
            return torch.softmax(model(**batch).logits, dim=-1)

    with torch.inference_mode():
        for c in calls[:3]:  # warm-up
            score(c)
        done, i, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            score(calls[i % len(calls)])
            done += args.batch
            i += 1
        elapsed = time.perf_counter() - started
    print(json.dumps({"runtime": "pytorch", "what": args.kind, "batch": args.batch,
                      "texts_per_second": done / elapsed}))


def main():
    if sys.argv[1:2] == ["make"]:
        make(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--kind", choices=["rerank", "classify"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--sentences", default="scripts/reference/bench_sentences.txt")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=2)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
