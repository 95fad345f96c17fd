"""Makes a Qwen2-family GGUF for the generation benchmark: Qwen2.5-0.5B-Instruct's shape (896
wide, 24 layers, 14 query heads over 2 key/value heads, q/k/v biases, feed-forward 4864, tied
embeddings, rope base 1e6) with random weights (fixed seed), Q8_0 for every matrix as
`llama-quantize` writes it (norms and biases f32), SmolLM2's byte-level BPE vocabulary under the
`qwen2` pre-tokenizer with Qwen's special tokens, and a ChatML template. Both servers read this
one file, so their speed is compared on the same arithmetic.

The end-of-turn and end-of-text tokens' output rows are zero: their logit is 0 while the largest
of 49k random logits is well above it, so greedy decoding never stops early and every request
decodes the tokens it asks for on both servers.

    python make_bench_decoder.py OUT.gguf SMOLLM2_GGUF     # needs the `gguf` package and numpy
"""

import sys

import gguf
import numpy as np

OUT, SMOLLM2 = sys.argv[1], sys.argv[2]

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 896, 24, 14, 2, 4864
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

reader = gguf.GGUFReader(SMOLLM2)
field = lambda key: reader.fields[key].contents()
tokens = list(field("tokenizer.ggml.tokens"))
merges = field("tokenizer.ggml.merges")
# SmolLM2's own control tokens become ordinary text here; Qwen's are the control tokens.
types = [gguf.TokenType.NORMAL if t == gguf.TokenType.CONTROL else t
         for t in field("tokenizer.ggml.token_type")]
for special in SPECIALS:
    if special in tokens:
        types[tokens.index(special)] = gguf.TokenType.CONTROL
    else:
        tokens.append(special)
        types.append(gguf.TokenType.CONTROL)
vocab = len(tokens)

rng = np.random.default_rng(0)


def normal(*shape, scale):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


def q8(array):
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)


w = gguf.GGUFWriter(OUT, "qwen2")
w.add_name("nomad-bench-qwen2-0.5b-shape")
w.add_context_length(32768)
w.add_embedding_length(HIDDEN)
w.add_block_count(LAYERS)
w.add_feed_forward_length(FFN)
w.add_head_count(HEADS)
w.add_head_count_kv(KV_HEADS)
w.add_rope_dimension_count(HEAD_DIM)
w.add_rope_freq_base(1000000.0)
w.add_layer_norm_rms_eps(1e-6)
w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
w.add_vocab_size(vocab)
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("qwen2")
w.add_token_list(tokens)
w.add_token_types(types)
w.add_token_merges(merges)
w.add_eos_token_id(tokens.index("<|im_end|>"))
w.add_pad_token_id(tokens.index("<|endoftext|>"))
w.add_add_bos_token(False)
w.add_chat_template(TEMPLATE)

embedding = normal(vocab, HIDDEN, scale=1.0)
for special in SPECIALS:
    embedding[tokens.index(special)] = 0.0  # tied: this is also the output row (see above)
w.add_tensor("token_embd.weight", q8(embedding), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
w.add_tensor("output_norm.weight", 1.0 + normal(HIDDEN, scale=0.1))
scale = HIDDEN ** -0.5
for i in range(LAYERS):
    blk = lambda name: f"blk.{i}.{name}"
    matrix = lambda name, rows, cols, s: w.add_tensor(
        blk(name), q8(normal(rows, cols, scale=s)), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor(blk("attn_norm.weight"), 1.0 + normal(HIDDEN, scale=0.1))
    matrix("attn_q.weight", HEADS * HEAD_DIM, HIDDEN, scale)
    matrix("attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, scale)
    matrix("attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, scale)
    w.add_tensor(blk("attn_q.bias"), normal(HEADS * HEAD_DIM, scale=0.1))
    w.add_tensor(blk("attn_k.bias"), normal(KV_HEADS * HEAD_DIM, scale=0.1))
    w.add_tensor(blk("attn_v.bias"), normal(KV_HEADS * HEAD_DIM, scale=0.1))
    matrix("attn_output.weight", HIDDEN, HEADS * HEAD_DIM, scale)
    w.add_tensor(blk("ffn_norm.weight"), 1.0 + normal(HIDDEN, scale=0.1))
    matrix("ffn_gate.weight", FFN, HIDDEN, scale)
    matrix("ffn_up.weight", FFN, HIDDEN, scale)
    matrix("ffn_down.weight", HIDDEN, FFN, FFN ** -0.5)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"{OUT}: qwen2, {LAYERS} layers x {HIDDEN}, vocabulary {vocab}, Q8_0")
