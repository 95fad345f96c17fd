"""Calls Nomad's OpenAI-compatible routes with the official `openai` Python client, for the
gateway's tests.

    openai_client.py BASE_URL TOKEN < ops.json

ops.json is a list of operations; one JSON line is printed per operation, in order:
  {"op": "models"}                                   -> {"models": [{"id", "kind"}]}
  {"op": "embeddings", "model", "input", "encoding_format"?}
                                                     -> {"vectors": [[...]], "object"}
  {"op": "chat", "model", "messages", "stream"?, "headers"?, ...sampling}
                                                     -> {"text", "finish_reason", "usage", "pieces"}
  {"op": "completion", "model", "prompt", "stream"?, ...sampling}  -> the same
  {"op": "chats", "count", ...chat}                  -> {"texts": [...]} (all at once, streamed)
  {"op": "rerank", "body"}                           -> the response body (the client's raw POST)
Any failure prints {"status": HTTP status, "error": the error body} (or {"exception": ...}).
"""

import asyncio
import json
import sys

import openai

BASE, TOKEN = sys.argv[1], sys.argv[2]
SAMPLING = ("max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream_options",
            "max_completion_tokens", "logit_bias", "presence_penalty")


def sampling(op):
    return {k: op[k] for k in SAMPLING if k in op}


async def generation(client, op):
    kwargs = dict(model=op["model"], stream=op.get("stream", False), **sampling(op))
    if op.get("headers"):
        kwargs["extra_headers"] = op["headers"]
    if op["op"] in ("chat", "chats"):
        call = client.chat.completions.create(messages=op["messages"], **kwargs)
    else:
        call = client.completions.create(prompt=op["prompt"], **kwargs)
    if not op.get("stream"):
        r = await call
        choice = r.choices[0]
        text = choice.message.content if op["op"] != "completion" else choice.text
        return {"text": text, "finish_reason": choice.finish_reason,
                "usage": r.usage.model_dump() if r.usage else None, "pieces": 1}
    text, pieces, finish, usage = "", 0, None, None
    async for chunk in await call:
        if chunk.usage:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            piece = choice.delta.content if op["op"] != "completion" else choice.text
            if piece:
                text += piece
                pieces += 1
            if choice.finish_reason:
                finish = choice.finish_reason
    return {"text": text, "finish_reason": finish, "usage": usage, "pieces": pieces}


async def run(client, op):
    kind = op["op"]
    if kind == "models":
        listed = await client.models.list()
        return {"models": [{"id": m.id, "kind": getattr(m, "kind", None)} for m in listed.data]}
    if kind == "embeddings":
        kwargs = {"encoding_format": op["encoding_format"]} if "encoding_format" in op else {}
        if "dimensions" in op:
            kwargs["dimensions"] = op["dimensions"]
        r = await client.embeddings.create(model=op["model"], input=op["input"], **kwargs)
        return {"vectors": [list(d.embedding) for d in r.data], "object": r.object}
    if kind in ("chat", "completion"):
        return await generation(client, op)
    if kind == "chats":
        texts = await asyncio.gather(*(generation(client, {**op, "stream": True}) for _ in range(op["count"])))
        return {"texts": [t["text"] for t in texts]}
    if kind == "rerank":
        r = await client.post("/rerank", body=op["body"], cast_to=object)
        return r
    raise ValueError(kind)


async def main():
    ops = json.load(sys.stdin)
    client = openai.AsyncOpenAI(base_url=BASE, api_key=TOKEN, max_retries=0, timeout=120)
    for op in ops:
        try:
            result = await run(client, op)
        except openai.APIStatusError as e:
            try:
                body = e.response.json()
            except Exception:  # noqa: BLE001
                body = e.response.text
            result = {"status": e.status_code, "error": body}
        except Exception as e:  # noqa: BLE001
            result = {"exception": repr(e)}
        print(json.dumps(result), flush=True)


asyncio.run(main())
