"""Generate and cache the tiny models: a GGUF file for llama-server and a Hugging Face dir for vLLM."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.e2e import tiny_spec as spec
from tests.e2e.cache import build_lock, cache_root, log

REPO_ROOT = Path(__file__).resolve().parents[2]
GGUF_NAME = "tiny-llama.gguf"
HF_DONE = ".complete"

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def model_dir() -> Path:
    return cache_root() / "models" / f"tiny-llama-{spec.fingerprint()}"


def _permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's rope pairs dimensions differently from HF; the converter reorders q/k rows the
    # same way, so the GGUF and the HF model compute the same function.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors() -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, arr in spec.weights().items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = arr
        elif name == "model.norm.weight":
            out["output_norm.weight"] = arr
        elif name == "lm_head.weight":
            out["output.weight"] = arr
        else:
            _, _, idx, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            if module == "self_attn.q_proj":
                arr = _permute_rope(arr, spec.N_HEAD)
            elif module == "self_attn.k_proj":
                arr = _permute_rope(arr, spec.N_HEAD_KV)
            out[f"blk.{idx}.{_HF_TO_GGUF[module]}.weight"] = np.ascontiguousarray(arr)
    return out


def write_gguf(path: Path) -> None:
    import gguf  # only this generator needs it; keeps the module importable without it

    tokens, merges = spec.vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("shapegate tiny llama (random weights)")
    w.add_context_length(spec.N_CTX_TRAIN)
    w.add_embedding_length(spec.N_EMBD)
    w.add_block_count(spec.N_LAYERS)
    w.add_feed_forward_length(spec.N_FF)
    w.add_head_count(spec.N_HEAD)
    w.add_head_count_kv(spec.N_HEAD_KV)
    w.add_rope_dimension_count(spec.HEAD_DIM)
    w.add_rope_freq_base(spec.ROPE_THETA)
    w.add_layer_norm_rms_eps(spec.RMS_EPS)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([
        gguf.TokenType.CONTROL if t in spec.SPECIALS else gguf.TokenType.NORMAL for t in tokens
    ])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(spec.token_id(spec.BOS))
    w.add_eos_token_id(spec.token_id(spec.IM_END))
    w.add_eot_token_id(spec.token_id(spec.IM_END))
    w.add_pad_token_id(spec.token_id(spec.BOS))
    w.add_add_bos_token(False)
    w.add_chat_template(spec.CHAT_TEMPLATE)
    for name, arr in _gguf_tensors().items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ensure_gguf_model() -> Path:
    """Path of the cached GGUF model, written first when absent."""
    path = model_dir() / GGUF_NAME
    if path.is_file():
        return path
    with build_lock("tiny-gguf"):
        if not path.is_file():
            started = time.monotonic()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial")
            write_gguf(tmp)
            os.replace(tmp, path)
            log(f"tiny GGUF model written in {time.monotonic() - started:.1f} s -> {path}")
    return path


def ensure_hf_model(venv_python: Path) -> Path:
    """Path of the cached Hugging Face model dir; written by the vLLM venv (torch-free writer there)."""
    target = model_dir() / "hf"
    if (target / HF_DONE).is_file():
        return target
    with build_lock("tiny-hf"):
        if not (target / HF_DONE).is_file():
            started = time.monotonic()
            shutil.rmtree(target, ignore_errors=True)
            cmd = [str(venv_python), "-m", "tests.e2e.tiny_hf", str(target)]
            proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"tiny HF model generation failed:\n{proc.stdout}\n{proc.stderr}")
            (target / HF_DONE).write_text(spec.fingerprint())
            log(f"tiny HF model written in {time.monotonic() - started:.1f} s -> {target}")
    return target


def main() -> int:
    print(ensure_gguf_model())
    if len(sys.argv) > 1:  # optional: path of the vLLM venv's python
        print(ensure_hf_model(Path(sys.argv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
