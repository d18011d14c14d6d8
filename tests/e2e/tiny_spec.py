"""The tiny random-weight llama model both engines serve: vocabulary, chat template, shapes and weights.

Only the stdlib and numpy are used, so the same spec is imported by the GGUF writer (project env)
and by the Hugging Face writer (inside the vLLM venv).
"""

from __future__ import annotations

import collections
import hashlib
import re

import numpy as np

# Bump when anything below changes: cached models are keyed by it.
MODEL_VERSION = "4"

N_LAYERS = 4
N_EMBD = 128
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 256
N_CTX_TRAIN = 4096
RMS_EPS = 1e-5
ROPE_THETA = 10000.0
N_MERGES = 200
SEED = 20240601

BOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = [BOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A fixed text to learn BPE merges from: any English works, it only has to be deterministic.
_CORPUS = """
The gateway sends each request to the engine that serves its shape best. Long outputs go to the
engine with the lowest inter token latency, long prompts to the one with the lowest time to first
token. The latency of every stream is measured by the gateway itself, and the model of each engine
is updated after every request. An engine that has just started is warmed up before real traffic.
When all slots are busy the request waits in a queue; the queue length is read from the metrics.
This is a small test of the tokenizer and the server, with words that repeat: the the the and and
to to of of in in is is that that for for with with on on it it as as be be at at by by this this.
"""

# GPT-2 pre-tokenisation pattern without \p classes (stdlib `re` lacks them); close enough for training.
_PRETOKEN = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def _train_merges(n_merges: int) -> list[tuple[str, str]]:
    b2u = bytes_to_unicode()
    words = collections.Counter(
        tuple(b2u[b] for b in piece.encode()) for piece in _PRETOKEN.findall(_CORPUS.strip())
    )
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        # ties broken lexically so the result never depends on dict order
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        merged: collections.Counter[tuple[str, ...]] = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def vocab() -> tuple[list[str], list[tuple[str, str]]]:
    """Tokens (id = index: 256 bytes, then merges, then specials) and the ordered merges."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = _train_merges(N_MERGES)
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            tokens.append(a + b)
            seen.add(a + b)
    tokens.extend(SPECIALS)
    return tokens, merges


def token_id(name: str) -> int:
    return vocab()[0].index(name)


def printable_mask(tokens: list[str]) -> np.ndarray:
    """True for tokens whose bytes are printable ASCII (or newline): safe to emit as text."""
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    mask = np.zeros(len(tokens), dtype=bool)
    for i, tok in enumerate(tokens):
        if tok in SPECIALS:
            continue
        raw = bytes(u2b[ch] for ch in tok)
        mask[i] = all(0x20 <= c < 0x7F or c == 0x0A for c in raw)
    return mask


def weights() -> dict[str, np.ndarray]:
    """Hugging Face-named float32 weights, (out, in) layout.

    Random logits would sample partial UTF-8 bytes and NUL. Llama has no output bias, so one
    hidden dimension is made a constant "bias channel": every embedding carries 1.0 there, the
    layers add only small noise, and the output row of each token reads that channel with +3
    (printable) or -3 (everything else, including the specials, so generation runs to max_tokens).
    """
    rng = np.random.default_rng(SEED)
    tokens, _ = vocab()
    n_vocab = len(tokens)

    def rand(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    emb = rand(n_vocab, N_EMBD)
    emb[:, 0] = 1.0
    head = rand(n_vocab, N_EMBD, std=0.5)
    head[:, 0] = np.where(printable_mask(tokens), 3.0, -3.0)
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": emb,
        "model.norm.weight": np.ones(N_EMBD, dtype=np.float32),
        "lm_head.weight": head,
    }
    kv = N_HEAD_KV * HEAD_DIM
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        w[p + "self_attn.q_proj.weight"] = rand(N_EMBD, N_EMBD)
        w[p + "self_attn.k_proj.weight"] = rand(kv, N_EMBD)
        w[p + "self_attn.v_proj.weight"] = rand(kv, N_EMBD)
        w[p + "self_attn.o_proj.weight"] = rand(N_EMBD, N_EMBD)
        w[p + "mlp.gate_proj.weight"] = rand(N_FF, N_EMBD)
        w[p + "mlp.up_proj.weight"] = rand(N_FF, N_EMBD)
        w[p + "mlp.down_proj.weight"] = rand(N_EMBD, N_FF)
    return w


def fingerprint() -> str:
    """Content key for the cache: changes whenever the vocabulary, template or version does."""
    tokens, merges = vocab()
    h = hashlib.sha256()
    h.update(MODEL_VERSION.encode())
    h.update("\x00".join(tokens).encode())
    h.update("\x00".join(a + " " + b for a, b in merges).encode())
    h.update(CHAT_TEMPLATE.encode())
    return f"v{MODEL_VERSION}-{h.hexdigest()[:10]}"
