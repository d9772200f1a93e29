"""Export to the Hugging Face `transformers` layout: GPT-2 for the gpt family, Llama for llama.

Owns: the parameter mapping from our `Transformer` to `GPT2LMHeadModel` / `LlamaForCausalLM`
(`hf_state_dict`), their `config.json` (`hf_config`), the tokenizer files `AutoTokenizer` loads
(`tokenizer_files`) and `write_hf_folder`, which writes them all. `transformers` itself is not
needed to export (only to load the folder).

Why the mapping is exact (docs/export.md):
- gpt -> GPT-2: pre-norm blocks with LayerNorm (bias), learned positions, GELU with the tanh
  approximation (`gelu_new`), biases on every Linear but the LM head, attention scaled by
  1/sqrt(head_dim). GPT-2's `Conv1D` stores weights as [in, out], ours (`nn.Linear`) as [out, in]:
  every block matrix is transposed. Our fused qkv is split q|k|v along the output like GPT-2's
  `c_attn`. Our LM head is untied: `tie_word_embeddings = false` and `lm_head.weight` is written.
- llama -> Llama: RMSNorm (weight only), rotate-half RoPE over the whole head (the convention of
  HF's Llama: no permutation), SwiGLU, grouped-query attention, no biases, untied head. Our fused
  qkv splits into q_proj (d rows) | k_proj (kv rows) | v_proj (kv rows), our fused gate_up into
  gate_proj (first d_ff rows) | up_proj.
Must not import asyncio, socket, threading, or anything from gwtf.runtime / gwtf.protocol.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from gwtf.model.presets import ModelSpec
from gwtf.model.tokenizer import EOT, BpeTokenizer, ByteTokenizer, FileTokenizer, Tokenizer
from gwtf.model.transformer import Transformer

__all__ = ["DTYPES", "hf_config", "hf_state_dict", "tokenizer_files", "write_hf_folder"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _gpt2_state(sd: dict[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    out = {
        "transformer.wte.weight": sd["embedding.tokens.weight"],
        "transformer.wpe.weight": sd["embedding.positions.weight"],
        "transformer.ln_f.weight": sd["head.norm.weight"],
        "transformer.ln_f.bias": sd["head.norm.bias"],
        "lm_head.weight": sd["head.out.weight"],
    }
    pairs = {  # ours -> GPT-2's, (transposed?)
        "norm1": ("ln_1", False), "norm2": ("ln_2", False), "attn.qkv": ("attn.c_attn", True),
        "attn.proj": ("attn.c_proj", True), "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True),
    }
    for i in range(spec.n_layer):
        for ours, (theirs, transpose) in pairs.items():
            weight = sd[f"blocks.{i}.{ours}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = weight.t() if transpose else weight
            out[f"transformer.h.{i}.{theirs}.bias"] = sd[f"blocks.{i}.{ours}.bias"]
    return out


def _llama_state(sd: dict[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    out = {
        "model.embed_tokens.weight": sd["embedding.tokens.weight"],
        "model.norm.weight": sd["head.norm.weight"],
        "lm_head.weight": sd["head.out.weight"],
    }
    d, kv, ff = spec.d_model, spec.kv_dim, spec.d_ff
    for i in range(spec.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = sd[ours + "attn.qkv.weight"].split((d, kv, kv), dim=0)
        gate, up = sd[ours + "mlp.gate_up.weight"].split((ff, ff), dim=0)
        out.update({
            theirs + "input_layernorm.weight": sd[ours + "norm1.weight"],
            theirs + "post_attention_layernorm.weight": sd[ours + "norm2.weight"],
            theirs + "self_attn.q_proj.weight": q, theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v, theirs + "self_attn.o_proj.weight": sd[ours + "attn.proj.weight"],
            theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": sd[ours + "mlp.down.weight"],
        })
    return out


def hf_state_dict(model: Transformer, dtype: str = "fp32") -> dict[str, Tensor]:
    """Our weights under the HF model's names and shapes, contiguous CPU tensors of `dtype`."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    mapped = _gpt2_state(sd, model.spec) if model.spec.family == "gpt" else _llama_state(sd, model.spec)
    return {k: v.to(device="cpu", dtype=DTYPES[dtype]).contiguous() for k, v in mapped.items()}


def hf_config(spec: ModelSpec, eot_id: int, dtype: str = "fp32") -> dict[str, Any]:
    """`config.json` of the HF model equivalent to `spec` (no dropout: an export is for inference)."""
    common: dict[str, Any] = {
        "vocab_size": spec.vocab_size, "bos_token_id": eot_id, "eos_token_id": eot_id,
        "tie_word_embeddings": False, "torch_dtype": _DTYPE_NAMES[dtype], "dtype": _DTYPE_NAMES[dtype],
        "use_cache": True,
    }
    if spec.family == "gpt":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
            "n_positions": spec.seq_len, "n_embd": spec.d_model, "n_layer": spec.n_layer,
            "n_head": spec.n_head, "n_inner": spec.d_ff, "activation_function": "gelu_new",
            "layer_norm_epsilon": spec.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "initializer_range": 0.02,
        }
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
        "hidden_size": spec.d_model, "intermediate_size": spec.d_ff, "num_hidden_layers": spec.n_layer,
        "num_attention_heads": spec.n_head, "num_key_value_heads": spec.n_kv_head, "head_dim": spec.head_dim,
        "hidden_act": "silu", "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
        "pretraining_tp": 1,
    }


def _byte_tokenizer_json() -> str:
    """Our byte tokenizer as a `tokenizers` pipeline: ids 0..255 are the UTF-8 bytes, 256 is EOT
    (byte-level alphabet, a BPE with no merges, so each byte is one token)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HfTokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 stand-ins (a set: no byte order)
    stand_in = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(stand_in.values())
    inner = HfTokenizer(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([AddedToken(EOT, special=True)])
    assert inner.token_to_id(EOT) == 256
    return str(inner.to_str())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the one `ByteLevel` uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_files(tokenizer: Tokenizer, seq_len: int) -> dict[str, str]:
    """File name -> text of the tokenizer files: tokenizer.json (a `tokenizers` pipeline
    identical to ours), tokenizer_config.json and special_tokens_map.json. A tokenizer read from
    files (an imported model's, `data.tokenizer` = a path) is written back as read, its side files
    too; the ones it lacks are made naming its end-of-text token."""
    if isinstance(tokenizer, FileTokenizer):
        special = {"bos_token": tokenizer.eot_token, "eos_token": tokenizer.eot_token}
        made = {
            "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special,
                                                 "model_max_length": seq_len}, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2),
        }
        side = {name: text.rstrip("\n") for name, text in tokenizer.side_files.items()}
        return {"tokenizer.json": tokenizer.to_json().rstrip("\n"), **made, **side}
    if isinstance(tokenizer, BpeTokenizer):
        pipeline = tokenizer.to_json()
    elif isinstance(tokenizer, ByteTokenizer):
        pipeline = _byte_tokenizer_json()
    else:
        raise TypeError(f"cannot export a {type(tokenizer).__name__}")
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": seq_len,
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
    }
    return {
        "tokenizer.json": pipeline,
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }


def write_hf_folder(model: Transformer, tokenizer: Tokenizer, out_dir: str | Path, dtype: str = "fp32") -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eot = tokenizer.eot_id
    files = {
        "config.json": json.dumps(hf_config(model.spec, eot, dtype), indent=2),
        "generation_config.json": json.dumps({"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot},
                                             indent=2),
        **tokenizer_files(tokenizer, model.spec.seq_len),
    }
    tmp = out / f".model.safetensors.tmp{os.getpid()}"
    save_file(hf_state_dict(model, dtype), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    for name, text in files.items():
        (out / name).write_text(text + "\n", encoding="utf-8")
    return out
