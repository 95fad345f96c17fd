"""Makes the decoder test models and their references: small GGUF files with random weights
(fixed seeds) in each family's real layout (llama with Llama 3's tokenizer, llama with a
SentencePiece vocabulary and Mistral's template, qwen2 with its q/k/v biases, qwen3 with its q/k
norms, wider heads and tied embeddings), written with `gguf` (the package llama.cpp ships), with
a real vocabulary (SmolLM2's byte-level BPE from the default model, or the same pieces as
SentencePiece pieces with byte fallback) under each family's own pre-tokenizer, special tokens
and chat template. transformers
then loads each GGUF itself (its own tokenizer conversion, its own un-permuting of llama's q/k,
jinja2 for the template) and computes what Nomad should answer. Nomad's answers are checked
against these, never against its own output.

    python make_decoders.py OUT_DIR SMOLLM2_GGUF

Writes OUT_DIR/<case>.gguf and OUT_DIR/cases.json: a list of {"name", "file", "requests": [...]}
where each request is {"text" or "messages", "chat", "prompt_tokens", "max_tokens", "expected"}
(or {"messages", "refused"}: the template's own refusal; "expected" is null where not one
greedy step is clear):
the prompt's token count as transformers tokenizes it, and transformers' greedy continuation for
as many steps as its top two logits stay apart (a near-tie is decided by float rounding, not by
the model), no special token is picked and the text ends on a whole character.
"""

import json
import os
import sys

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT, SMOLLM2 = sys.argv[1], sys.argv[2]
os.makedirs(OUT, exist_ok=True)
torch.set_grad_enabled(False)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# ChatML with a default system line and a tools branch, in the style Qwen2.5 ships.
QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# In the style Qwen3 ships: a namespace, a reversed walk, Python string methods. (Its heads are
# 128 wide, wider than hidden / heads, as Qwen3's are: transformers reads no key_length from a
# GGUF and takes Qwen3's 128.)
QWEN3_TEMPLATE = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system") %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n\\n</think>\\n\\n' + content.rstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Mistral 7B v0.1's template: roles must alternate, and a system message is refused.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

CASES = [
    {
        "name": "llama3",
        "seed": 0,
        "arch": "llama",
        "pre": "llama-bpe",
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "add_bos": True,
        "template": LLAMA3_TEMPLATE,
        "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": None, "ffn": 128, "layers": 2,
        "bias": False, "qk_norm": False, "tied": False, "freq_base": 500000.0,
    },
    {
        "name": "mistral",
        "seed": 3,
        "arch": "llama",
        "sentencepiece": True,
        "specials": [],
        "bos": "<s>",
        "eos": "</s>",
        "add_bos": True,
        "template": MISTRAL_TEMPLATE,
        "hidden": 64, "heads": 4, "kv_heads": 1, "head_dim": None, "ffn": 128, "layers": 2,
        "bias": False, "qk_norm": False, "tied": False, "freq_base": 10000.0,
    },
    {
        "name": "qwen2",
        "seed": 1,
        "arch": "qwen2",
        "pre": "qwen2",
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "add_bos": False,
        "template": QWEN2_TEMPLATE,
        "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": None, "ffn": 128, "layers": 2,
        "bias": True, "qk_norm": False, "tied": False, "freq_base": 1000000.0,
    },
    {
        "name": "qwen3",
        "seed": 2,
        "arch": "qwen3",
        "pre": "qwen2",
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        "bos": None,
        "eos": "<|im_end|>",
        "add_bos": False,
        "template": QWEN3_TEMPLATE,
        "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 128, "ffn": 128, "layers": 2,
        "bias": False, "qk_norm": True, "tied": True, "freq_base": 1000000.0,
    },
]

TEXTS = [
    "Numbers: 12345, 3.14159 and 2026-12-04",
    "It's the cat's toy, isn't it?\n\n  Indented   line\r\nend",
    "Café crème brûlée, naïve façade 東京 😀",
]
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "  What colour is the sky?  "},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
]
PROMPTS = ["What is 2 + 2?", "Write a haiku about 1234 waves."]
MAX_STEPS = 12
MARGIN = 0.05


def smollm2_vocab():
    reader = gguf.GGUFReader(SMOLLM2)
    field = lambda key: reader.fields[key].contents()
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    merges = field("tokenizer.ggml.merges")
    # SmolLM2's own control tokens stay, as ordinary text tokens of this vocabulary.
    types = [gguf.TokenType.NORMAL if t == gguf.TokenType.CONTROL else t for t in types]
    return tokens, types, merges


# Files Nomad must refuse at load, naming what it does not serve: each a served case with one
# fact changed (the test asserts the refusal).
REFUSED = [
    ("phi3-arch", "qwen2", {"arch": "phi3"}),
    ("tekken-pre", "qwen2", {"pre": "tekken"}),
    ("yarn-rope", "qwen2", {"rope_scaling": "yarn"}),
]


def bytes_to_unicode():
    """GPT-2's map from bytes to the characters byte-level vocabularies spell them with."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def sentencepiece_vocab(vocab):
    """A SentencePiece vocabulary from the byte-level one: each piece's text with `▁` for its
    spaces, scored by its rank; `<unk>`, `<s>`, `</s>` and the 256 byte pieces first."""
    tokens, _, _ = vocab
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    seen = set(pieces)
    for token in tokens:
        try:
            text = bytes(to_byte[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        text = text.replace(" ", "\u2581")
        if text and text not in seen:
            seen.add(text)
            pieces.append(text)
            types.append(gguf.TokenType.NORMAL)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    return pieces, types, scores


def write(case, vocab, seed):
    if case.get("sentencepiece"):
        tokens, types, scores = sentencepiece_vocab(vocab)
        merges = None
    else:
        tokens, types, merges = vocab
        scores = None
    tokens, types = list(tokens), list(types)
    for special in case["specials"]:  # a control token, added where the vocabulary lacks it
        if special in tokens:
            types[tokens.index(special)] = gguf.TokenType.CONTROL
        else:
            tokens.append(special)
            types.append(gguf.TokenType.CONTROL)
    rng = np.random.default_rng(seed)
    h, heads, kv, ffn = case["hidden"], case["heads"], case["kv_heads"], case["ffn"]
    d = case["head_dim"] or h // heads
    normal = lambda *shape, scale: (rng.standard_normal(shape) * scale).astype(np.float32)
    path = os.path.join(OUT, case["name"] + ".gguf")
    w = gguf.GGUFWriter(path, case["arch"])
    w.add_name(f"nomad-test-{case['name']}")
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_block_count(case["layers"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    if case["head_dim"]:
        w.add_key_length(d)
        w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(case["freq_base"])
    if case.get("rope_scaling"):
        w.add_rope_scaling_type(gguf.RopeScalingType(case["rope_scaling"]))
        w.add_rope_scaling_factor(4.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    if scores is not None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(True)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(case["pre"])
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    if case["bos"]:
        w.add_bos_token_id(tokens.index(case["bos"]))
    w.add_eos_token_id(tokens.index(case["eos"]))
    w.add_add_bos_token(case["add_bos"])
    w.add_chat_template(case["template"])
    w.add_tensor("token_embd.weight", normal(len(tokens), h, scale=1.0))
    w.add_tensor("output_norm.weight", 1.0 + normal(h, scale=0.1))
    if not case["tied"]:
        w.add_tensor("output.weight", normal(len(tokens), h, scale=1.0))
    for i in range(case["layers"]):
        blk = lambda name: f"blk.{i}.{name}"
        w.add_tensor(blk("attn_norm.weight"), 1.0 + normal(h, scale=0.1))
        w.add_tensor(blk("attn_q.weight"), normal(heads * d, h, scale=0.3))
        w.add_tensor(blk("attn_k.weight"), normal(kv * d, h, scale=0.3))
        w.add_tensor(blk("attn_v.weight"), normal(kv * d, h, scale=0.3))
        if case["bias"]:
            w.add_tensor(blk("attn_q.bias"), normal(heads * d, scale=0.5))
            w.add_tensor(blk("attn_k.bias"), normal(kv * d, scale=0.5))
            w.add_tensor(blk("attn_v.bias"), normal(kv * d, scale=0.5))
        if case["qk_norm"]:
            w.add_tensor(blk("attn_q_norm.weight"), 1.0 + normal(d, scale=0.2))
            w.add_tensor(blk("attn_k_norm.weight"), 1.0 + normal(d, scale=0.2))
        w.add_tensor(blk("attn_output.weight"), normal(h, heads * d, scale=0.3))
        w.add_tensor(blk("ffn_norm.weight"), 1.0 + normal(h, scale=0.1))
        w.add_tensor(blk("ffn_gate.weight"), normal(ffn, h, scale=0.3))
        w.add_tensor(blk("ffn_up.weight"), normal(ffn, h, scale=0.3))
        w.add_tensor(blk("ffn_down.weight"), normal(h, ffn, scale=0.3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def greedy(model, ids, special):
    """Greedy steps while the top two logits stay MARGIN apart and no special token wins."""
    out = []
    for _ in range(MAX_STEPS):
        logits = model(torch.tensor([ids + out])).logits[0, -1]
        top = torch.topk(logits, 2)
        token = int(top.indices[0])
        if float(top.values[0] - top.values[1]) < MARGIN or token in special:
            break
        out.append(token)
    return out


# Transformers directories (`save_pretrained`: config.json, safetensors, tokenizer.json and the
# template), as users bring them: each with the tokenizer of a GGUF case above, as transformers
# converted it.
DIRECTORIES = [
    {"name": "llama3-dir", "tokenizer_of": "llama3", "model_type": "llama", "seed": 10,
     "head_dim": 16, "tied": False, "dtype": torch.float32},
    # Heads wider than hidden / heads, tied embeddings, weights in bfloat16.
    {"name": "qwen3-dir", "tokenizer_of": "qwen3", "model_type": "qwen3", "seed": 11,
     "head_dim": 32, "tied": True, "dtype": torch.bfloat16},
    # Rope scaling: Llama 3.1's kind (an original context this short puts head_dim 16's
    # frequencies in all three of its bands) and linear.
    {"name": "llama31-dir", "tokenizer_of": "llama3", "model_type": "llama", "seed": 12,
     "head_dim": 16, "tied": False, "dtype": torch.float32,
     "rope": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"name": "linear-rope-dir", "tokenizer_of": "llama3", "model_type": "llama", "seed": 13,
     "head_dim": 16, "tied": False, "dtype": torch.float32,
     "rope": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    # A sliding window far shorter than the prompts: every layer attends to the last 6 positions.
    {"name": "mistral-window-dir", "tokenizer_of": "llama3", "model_type": "mistral", "seed": 14,
     "head_dim": 16, "tied": False, "dtype": torch.float32, "sliding_window": 6},
]


def write_directory(entry, tokenizer, case):
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        entry["model_type"], vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=entry["head_dim"], max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=entry["tied"],
        **({"rope_parameters": entry["rope"]} if "rope" in entry else {}),
        **({"sliding_window": entry["sliding_window"]} if "sliding_window" in entry else {}),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids(case["eos"]))
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(entry["seed"])
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif "embed" in name or "lm_head" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    directory = os.path.join(OUT, entry["name"])
    model.to(entry["dtype"]).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def references(case, tokenizer, model, specials, bos):
    """Every request of the test for one model, with what transformers answers."""
    special = set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids(t) for t in specials}
    requests = []

    def add(request, ids):
        out = greedy(model, ids, special)
        # A text cut inside a character is not compared (a decoder may hold its bytes back).
        while out and "\ufffd" in tokenizer.decode(out):
            out.pop()
        # No clear step: only the prompt's token count is compared.
        requests.append({
            **request,
            "prompt_tokens": len(ids),
            "max_tokens": max(len(out), 1),
            "expected": tokenizer.decode(out) if out else None,
        })

    for text in TEXTS:
        add({"text": text, "chat": False}, bos(text))
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        add({"text": prompt, "chat": True, "rendered": rendered}, ids)
    try:
        rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    except Exception as refused:  # the template's own raise_exception
        requests.append({"messages": CONVERSATION, "refused": str(refused)})
    else:
        add({"messages": CONVERSATION, "rendered": rendered},
            tokenizer.encode(rendered, add_special_tokens=False))
    steps = sum(r["max_tokens"] for r in requests if r.get("expected"))
    assert steps >= 3 * len(requests), f"{case}: only {steps} clear greedy steps"
    print(f"{case}: {len(requests)} requests", file=sys.stderr)
    return requests


def main():
    vocab = smollm2_vocab()
    cases, tokenizers = [], {}
    for case in CASES:
        path = write(case, vocab, case["seed"])
        name = os.path.basename(path)
        tokenizer = AutoTokenizer.from_pretrained(OUT, gguf_file=name)
        tokenizers[case["name"]] = tokenizer
        if case.get("sentencepiece"):
            # transformers' GGUF conversion puts the `▁` space prefix at the text's start only
            # (prepend_scheme "first"); SentencePiece models as their makers and llama.cpp
            # tokenize them put it after every special token too (Mistral's own tokenizer makes
            # `<s>[INST]` into `<s>`, `▁[`, `INST`, `]`), so the reference does as they do.
            from tokenizers import pre_tokenizers
            tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="\u2581", prepend_scheme="always", split=False)
        model = AutoModelForCausalLM.from_pretrained(OUT, gguf_file=name, dtype=torch.float32)
        model.eval()
        bos = [tokenizer.convert_tokens_to_ids(case["bos"])] if case["add_bos"] else []
        raw = lambda text: bos + tokenizer.encode(text, add_special_tokens=False)
        requests = references(case["name"], tokenizer, model, case["specials"], raw)
        cases.append({"name": case["name"], "file": name, "requests": requests})
    for entry in DIRECTORIES:
        case = next(c for c in CASES if c["name"] == entry["tokenizer_of"])
        directory = write_directory(entry, tokenizers[case["name"]], case)
        # Read back as a user's code would: the directory alone, weights as f32.
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        model.eval()
        raw = lambda text: tokenizer.encode(text)  # with the tokenizer's own special tokens
        requests = references(entry["name"], tokenizer, model, case["specials"], raw)
        cases.append({"name": entry["name"], "file": entry["name"], "requests": requests})
    for name, base, change in REFUSED:
        case = {**next(c for c in CASES if c["name"] == base), **change, "name": name, "layers": 1}
        write(case, vocab, 0)
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)


main()
