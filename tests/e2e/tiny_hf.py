"""Write the tiny model as a Hugging Face LlamaForCausalLM dir; runs inside the vLLM venv (`python -m tests.e2e.tiny_hf DIR`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.e2e import tiny_spec as spec


def _tokenizer_json(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = spec.vocab()
    plain = {tok: i for i, tok in enumerate(tokens) if tok not in spec.SPECIALS}
    tok = Tokenizer(models.BPE(vocab=plain, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in spec.SPECIALS])
    for s in spec.SPECIALS:
        # the specials must land on the same ids as in the GGUF vocabulary
        if tok.token_to_id(s) != spec.token_id(s):
            raise RuntimeError(f"special token {s} got id {tok.token_to_id(s)}, expected {spec.token_id(s)}")
    tok.save(str(path))


def _configs(out: Path, n_vocab: int) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.N_EMBD,
        "intermediate_size": spec.N_FF,
        "num_hidden_layers": spec.N_LAYERS,
        "num_attention_heads": spec.N_HEAD,
        "num_key_value_heads": spec.N_HEAD_KV,
        "head_dim": spec.HEAD_DIM,
        "max_position_embeddings": spec.N_CTX_TRAIN,
        "vocab_size": n_vocab,
        "rms_norm_eps": spec.RMS_EPS,
        "rope_theta": spec.ROPE_THETA,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": spec.token_id(spec.BOS),
        "eos_token_id": spec.token_id(spec.IM_END),
        "torch_dtype": "bfloat16",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.BOS,
        "eos_token": spec.IM_END,
        "pad_token": spec.BOS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.N_CTX_TRAIN,
        "chat_template": spec.CHAT_TEMPLATE,
    }
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
    }
    for name, body in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                       ("generation_config.json", generation_config)):
        (out / name).write_text(json.dumps(body, indent=2) + "\n")


def _self_check(out: Path) -> str:
    """Load it back the way vLLM will, so a broken dir fails here rather than inside the server."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "hello there"}],
                                   tokenize=False, add_generation_prompt=True)
    if not text.endswith("<|im_start|>assistant\n"):
        raise RuntimeError(f"chat template renders unexpectedly: {text!r}")
    ids = tok(text)["input_ids"]
    if ids[0] != spec.token_id(spec.IM_START) or tok.decode(ids) != text:
        raise RuntimeError(f"tokenizer round trip failed: {ids}")
    return f"{len(tok)} tokens, chat prompt = {len(ids)} tokens"


def main(out: Path) -> int:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tokens, _ = spec.vocab()
    _tokenizer_json(out / "tokenizer.json")
    _configs(out, len(tokens))
    # bfloat16 on disk: vLLM's CPU backend runs bf16 and would otherwise downcast (and warn) per tensor
    tensors = {name: torch.from_numpy(arr).to(torch.bfloat16) for name, arr in spec.weights().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"{out}: {_self_check(out)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.e2e.tiny_hf OUTPUT_DIR")
    raise SystemExit(main(Path(sys.argv[1])))
