# The demo's agent step. `TASK` holds the task's `inputs`; the script sets `RESULT`.
# Tools come from the fleet's built-in `nomad` server; the `_async` forms run concurrently,
# so the scheduler can batch the calls of one rollout together.
import asyncio
import math

from mcp_tools.nomad import embed_async, generate


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


kind = TASK["kind"]
if kind == "search":
    # Semantic search: the document whose embedding is closest to the query's.
    texts = [TASK["query"]] + TASK["documents"]
    replies = await asyncio.gather(*(embed_async(text=t) for t in texts))
    vectors = [r["output"] for r in replies]
    scores = [cosine(vectors[0], v) for v in vectors[1:]]
    RESULT = TASK["documents"][scores.index(max(scores))]
elif kind == "norm":
    # Sentence embeddings are unit vectors: the norm is 1.
    vector = (await embed_async(text=TASK["text"]))["output"]
    RESULT = math.sqrt(sum(x * x for x in vector))
elif kind == "answer":
    # A short answer from the chat model, scored by similarity to a reference answer.
    RESULT = generate(text=TASK["question"], max_tokens=TASK.get("max_tokens", 24))["text"].strip()
else:
    raise ValueError(f"unknown task kind {kind!r}")
