"""Makes the encoder test models and their references: small models with random weights (fixed
seeds) in each family's real layout with a real tokenizer, saved by transformers and
sentence-transformers themselves, and what those libraries compute for them. Nomad's answers are
checked against these, never against its own output.

    python make_encoders.py OUT_DIR BERT_TOKENIZER_DIR

Writes OUT_DIR/<case>/ model directories and OUT_DIR/cases.json: a list of {"name", "kind"
(embed | rerank | classify), "dir", "requests": [...], "expected": [...]} where each request is
{"text", "options"} and each expected answer what the reference computed for it.
"""

import json
import os
import sys

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers import models as st_models
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    CamembertConfig,
    CamembertForSequenceClassification,
    CamembertModel,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    DistilBertModel,
    ModernBertConfig,
    ModernBertModel,
    RobertaConfig,
    RobertaForSequenceClassification,
    RobertaModel,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
    XLMRobertaTokenizerFast,
)

OUT, BERT_TOKENIZER = sys.argv[1], sys.argv[2]
os.makedirs(OUT, exist_ok=True)

TEXTS = [
    "A cat sits on the warm mat.",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
    "hi",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up "
    "and the fox has to run away across the field.",
    "Électricité et magnétisme: 42 équations!",
    "Rerank these documents for a query about heat transfer in metals.",
]
DOCS = [
    "Copper conducts heat better than steel.",
    "The recipe needs two eggs.",
    "Thermal conductivity of metals depends on free electrons moving through the lattice.",
    "hi",
]

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def bert_tokenizer():
    return AutoTokenizer.from_pretrained(BERT_TOKENIZER)


def xlmr_tokenizer():
    """A real Unigram tokenizer trained here, in XLM-RoBERTa's shape (<s>=0, <pad>=1, </s>=2)."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = TEXTS + DOCS + [t.lower() for t in TEXTS] + ["the a of and to in is that for on with"] * 5
    trainer = trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>"
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return XLMRobertaTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
    )


def encoder(family, seed, head_labels=None, activation=None):
    """A random model of `family` (with a sequence classification head of `head_labels`, and
    `activation` in place of the family's default) and its tokenizer."""
    torch.manual_seed(seed)
    if family == "bert":
        tok = bert_tokenizer()
        config = BertConfig(vocab_size=tok.vocab_size, max_position_embeddings=128, **SMALL)
        cls = BertForSequenceClassification if head_labels else BertModel
    elif family == "distilbert":
        tok = bert_tokenizer()
        config = DistilBertConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                  max_position_embeddings=128)
        cls = DistilBertForSequenceClassification if head_labels else DistilBertModel
    elif family == "xlm-roberta":
        tok = xlmr_tokenizer()
        config = XLMRobertaConfig(vocab_size=len(tok), max_position_embeddings=130, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, type_vocab_size=1, **SMALL)
        cls = XLMRobertaForSequenceClassification if head_labels else XLMRobertaModel
    elif family in ("roberta", "camembert"):
        # XLM-RoBERTa's architecture under their own names and classes.
        tok = xlmr_tokenizer()
        config_class, model, head = {
            "roberta": (RobertaConfig, RobertaModel, RobertaForSequenceClassification),
            "camembert": (CamembertConfig, CamembertModel, CamembertForSequenceClassification),
        }[family]
        config = config_class(vocab_size=len(tok), max_position_embeddings=130, pad_token_id=1,
                              bos_token_id=0, eos_token_id=2, type_vocab_size=1, **SMALL)
        cls = head if head_labels else model
    elif family == "modernbert":
        tok = bert_tokenizer()
        config = ModernBertConfig(vocab_size=tok.vocab_size, max_position_embeddings=256, pad_token_id=0,
                                  cls_token_id=101, sep_token_id=102, bos_token_id=101, eos_token_id=102,
                                  global_attn_every_n_layers=2, local_attention=16, **SMALL)
        cls = ModernBertModel
    else:
        raise ValueError(family)
    if activation:
        setattr(config, "activation" if family == "distilbert" else "hidden_act", activation)
    # Weights ten times the usual initial scale: the MLP's inputs then reach the range where the
    # activations differ (the exact GELU and its tanh approximation agree within 1e-6 near 0).
    config.initializer_range = 0.2
    if head_labels:
        config.num_labels = len(head_labels)
        config.id2label = dict(enumerate(head_labels))
        config.label2id = {v: k for k, v in enumerate(head_labels)}
    model = cls(config).eval()
    # Random init leaves LayerNorms at 1/0 and some biases at 0: perturb every parameter so a
    # wrong weight mapping cannot go unnoticed.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model, tok


def save_hf(model, tok, path):
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


cases = []


def embed_case(name, family, seed, pooling, normalize=True, prompts=None, prompt_name=None,
               max_seq_length=96, activation=None):
    raw = os.path.join(OUT, f"_{name}-raw")
    model, tok = encoder(family, seed, activation=activation)
    save_hf(model, tok, raw)
    transformer = st_models.Transformer(raw, max_seq_length=max_seq_length)
    dim = transformer.get_word_embedding_dimension()
    modules = [transformer, st_models.Pooling(dim, **{f"pooling_mode_{m}": True for m in pooling})]
    if normalize:
        modules.append(st_models.Normalize())
    out = os.path.join(OUT, name)
    SentenceTransformer(modules=modules, prompts=prompts or {}).save(out)
    # What the library computes for the saved directory itself.
    reloaded = SentenceTransformer(out, device="cpu")
    vectors = reloaded.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True, batch_size=len(TEXTS))
    options = {"prompt": prompt_name} if prompt_name else {}
    cases.append({
        "name": name, "kind": "embed", "dir": out,
        "requests": [{"text": t, "options": options} for t in TEXTS],
        "expected": [v.tolist() for v in vectors],
    })


def score_case(name, family, seed, labels, kind, activation=None):
    out = os.path.join(OUT, name)
    model, tok = encoder(family, seed, head_labels=labels, activation=activation)
    save_hf(model, tok, out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    if kind == "rerank":
        query = TEXTS[5]
        batch = tok([query] * len(DOCS), DOCS, padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(**batch).logits[:, 0]
        scores = torch.sigmoid(logits).tolist()
        ranked = sorted(enumerate(scores), key=lambda p: (-p[1], p[0]))
        cases.append({
            "name": name, "kind": "rerank", "dir": out,
            "requests": [{"text": query, "options": {"documents": DOCS}},
                         {"text": query, "options": {"documents": DOCS, "top_n": 2, "raw_scores": True}}],
            "expected": [[{"index": i, "score": s} for i, s in ranked],
                         [{"index": i, "score": logits[i].item()} for i, _ in ranked[:2]]],
        })
    else:
        batch = tok(TEXTS, padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            probs = torch.softmax(model(**batch).logits, dim=-1).tolist()
        expected = []
        for p in probs:
            order = sorted(range(len(labels)), key=lambda i: (-p[i], i))
            expected.append({"label": labels[order[0]],
                             "scores": [{"label": labels[i], "score": p[i]} for i in order]})
        cases.append({
            "name": name, "kind": "classify", "dir": out,
            "requests": [{"text": t, "options": {}} for t in TEXTS],
            "expected": expected,
        })


embed_case("bert-mean", "bert", 1, ["mean_tokens"])
embed_case("bert-cls", "bert", 2, ["cls_token"], normalize=False)
embed_case("bert-max", "bert", 3, ["max_tokens"])
embed_case("bert-sqrt-last", "bert", 4, ["mean_sqrt_len_tokens", "lasttoken"], normalize=False)
embed_case("bert-prompts", "bert", 5, ["mean_tokens"], prompts={"query": "query: ", "passage": "passage: "},
           prompt_name="query")
embed_case("distilbert-mean", "distilbert", 6, ["mean_tokens"])
embed_case("xlm-roberta-cls", "xlm-roberta", 7, ["cls_token"])
embed_case("modernbert-mean", "modernbert", 8, ["mean_tokens"])
score_case("bert-rerank", "bert", 9, ["relevance"], "rerank")
score_case("xlm-roberta-rerank", "xlm-roberta", 10, ["relevance"], "rerank")
score_case("bert-classify", "bert", 11, ["negative", "neutral", "positive"], "classify")
score_case("distilbert-classify", "distilbert", 12, ["no", "yes"], "classify")
# The other activations the checkpoints of these families name.
embed_case("xlm-roberta-gelu-tanh", "xlm-roberta", 13, ["mean_tokens"], activation="gelu_pytorch_tanh")
score_case("distilbert-relu-classify", "distilbert", 14, ["no", "yes"], "classify", activation="relu")
embed_case("bert-relu", "bert", 15, ["mean_tokens"], activation="relu")
embed_case("xlm-roberta-silu", "xlm-roberta", 16, ["cls_token"], activation="silu")
embed_case("roberta-mean", "roberta", 17, ["mean_tokens"])
score_case("camembert-rerank", "camembert", 18, ["relevance"], "rerank")

with open(os.path.join(OUT, "cases.json"), "w") as f:
    json.dump(cases, f)
print(f"{len(cases)} cases in {OUT}")
