"""Import from the Hugging Face `transformers` layout: GPT-2 and Llama folders as our `Transformer`.

Owns: reading a folder's config.json into the shape keys of `gwtf.config.ModelConfig`, refusing
with the config key named what our model code does not compute (`open_hf_folder`); the index of
its safetensors (model.safetensors, or shards named by model.safetensors.index.json; read with
safetensors only, never torch.load / pickle); the mapping of its tensors onto our parameter
names (`hf_tensors`), the inverse of `gwtf.model.hub`'s; and `import_hf_folder`, which writes a
gwtf checkpoint (version 0, `gwtf.model.checkpoint`'s layout) plus the model's tokenizer files.

The mapping (docs/models.md):
- GPT-2 (`transformer.` prefix optional): `Conv1D` stores [in, out], our `nn.Linear` [out, in], so
  every block matrix is transposed; `c_attn` is our fused qkv as is. A tied LM head (GPT-2's
  default, no `lm_head.weight` stored) becomes an untied copy of `wte`.
- Llama (`model.` prefix optional): q_proj | k_proj | v_proj concatenated along the output are
  our qkv, gate_proj | up_proj our gate_up; rotate-half RoPE needs no permutation.
- The causal-mask buffers of old GPT-2 files (`attn.bias`, `attn.masked_bias`) and RoPE's
  `inv_freq` are derived data and skipped; any other tensor without a place in our model refuses
  the import (nothing is dropped silently).
Weights are read as float32 whatever their stored dtype. Dropout rates of the config are training
settings and are not imported (model.dropout is).
Must not import asyncio, socket, threading, or anything from gwtf.runtime / gwtf.protocol.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gwtf.config import Config, DataConfig, ModelConfig, to_dict, write_resolved
from gwtf.errors import UserError
from gwtf.model.partition import partition_layers
from gwtf.model.presets import ModelSpec, model_spec
from gwtf.model.tokenizer import SIDE_FILES, TOKENIZER_JSON, load_tokenizer_file

__all__ = [
    "IMPORT_STAGES",
    "TOKENIZER_DIR",
    "HfFolder",
    "ImportResult",
    "hf_tensors",
    "import_hf_folder",
    "is_hf_folder",
    "open_hf_folder",
    "shape_of_spec",
    "split_state",
]

HF_CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_DIR = "tokenizer"  # the imported model's tokenizer files, inside the output folder
IMPORT_STAGES = 2  # stage 0 + one relay stage with every block; model.init_from re-cuts to any model.stages
_SKIPPED = re.compile(r"(^|\.)(h\.\d+\.attn\.(bias|masked_bias)|rotary_emb\.inv_freq)$")
_PREFIX = {"gpt": "transformer.", "llama": "model."}
_ARCH = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


@dataclass(frozen=True, slots=True)
class HfFolder:
    """An opened GPT-2 / Llama folder: its shape (ModelConfig keys) and where each tensor lives."""

    path: Path
    family: str
    shape: dict[str, Any]  # family, n_layer, d_model, n_head, n_kv_head, d_ff, vocab_size, max_positions, ...
    tied: bool  # tie_word_embeddings: the LM head is the token embedding
    files: dict[str, tuple[Path, str]]  # name without the model prefix -> (safetensors file, stored key)
    eos_token_id: int | None

    @property
    def architecture(self) -> str:
        return _ARCH[self.family]


def is_hf_folder(path: str | Path) -> bool:
    """A folder with a config.json and safetensors weights (one file or an index of shards)."""
    p = Path(path)
    return (p / HF_CONFIG).is_file() and ((p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file())


# ---- config.json -> shape ---------------------------------------------------------------------


class _Config:
    """config.json with checks that name the key (and the folder) in one UserError."""

    def __init__(self, data: dict[str, Any], where: Path) -> None:
        self.data, self.where = data, where

    def refuse(self, key: str, value: Any, why: str) -> UserError:
        return UserError(f"{self.where / HF_CONFIG}: {key} = {json.dumps(value)} is not supported ({why})")

    def int(self, key: str, default: int | None = None) -> int:
        value = self.data.get(key, default)
        if value is None and default is None:
            raise UserError(f"{self.where / HF_CONFIG}: {key} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.refuse(key, value, "a positive integer is expected")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise self.refuse(key, value, "a positive number is expected")
        return float(value)

    def only(self, key: str, allowed: tuple[Any, ...], default: Any, why: str) -> None:
        value = self.data.get(key, default)
        if value not in allowed:
            raise self.refuse(key, value, why)


def _gpt2_shape(c: _Config) -> dict[str, Any]:
    c.only("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new",
           "gwtf's gpt MLP is GELU with the tanh approximation")
    c.only("scale_attn_weights", (True,), True, "gwtf scales attention scores by 1/sqrt(head_dim)")
    c.only("scale_attn_by_inverse_layer_idx", (False,), False, "gwtf does not scale attention by layer")
    c.only("add_cross_attention", (False,), False, "gwtf's blocks have no cross-attention")
    d, n_head = c.int("n_embd"), c.int("n_head")
    return {
        "family": "gpt", "n_layer": c.int("n_layer"), "d_model": d, "n_head": n_head, "n_kv_head": n_head,
        "d_ff": 4 * d if c.data.get("n_inner") is None else c.int("n_inner"),  # GPT-2: null = 4 x n_embd
        "vocab_size": c.int("vocab_size"), "max_positions": c.int("n_positions"),
        "rope_theta": ModelConfig().rope_theta, "norm_eps": c.float("layer_norm_epsilon", 1e-5),
    }


def _rope_theta(c: _Config) -> float:
    scaling = c.data.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            raise c.refuse("rope_scaling", scaling, "gwtf's RoPE has no scaling")
    params = c.data.get("rope_parameters")
    if params is None:
        return c.float("rope_theta", 10000.0)
    if not isinstance(params, dict):
        raise c.refuse("rope_parameters", params, "a table is expected")
    if params.get("rope_type", "default") != "default":
        raise c.refuse("rope_parameters.rope_type", params.get("rope_type"), "gwtf's RoPE has no scaling")
    extra = sorted(set(params) - {"rope_type", "rope_theta"})
    if extra:
        raise c.refuse(f"rope_parameters.{extra[0]}", params[extra[0]], "gwtf's RoPE is the default one")
    return _Config(params, c.where).float("rope_theta", c.float("rope_theta", 10000.0))


def _llama_shape(c: _Config) -> dict[str, Any]:
    c.only("hidden_act", ("silu",), "silu", "gwtf's llama MLP is SwiGLU (silu)")
    c.only("attention_bias", (False,), False, "gwtf's llama attention has no biases")
    c.only("mlp_bias", (False,), False, "gwtf's llama MLP has no biases")
    d, n_head = c.int("hidden_size"), c.int("num_attention_heads")
    head_dim = c.data.get("head_dim")
    if head_dim is not None and head_dim != d // n_head:
        raise c.refuse("head_dim", head_dim, f"gwtf's head_dim is hidden_size / num_attention_heads = {d // n_head}")
    return {
        "family": "llama", "n_layer": c.int("num_hidden_layers"), "d_model": d, "n_head": n_head,
        "n_kv_head": c.int("num_key_value_heads", n_head), "d_ff": c.int("intermediate_size"),
        "vocab_size": c.int("vocab_size"), "max_positions": c.int("max_position_embeddings"),
        "rope_theta": _rope_theta(c), "norm_eps": c.float("rms_norm_eps", 1e-6),
    }


def _read_config(folder: Path) -> _Config:
    path = folder / HF_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a readable config.json ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a JSON object")
    return _Config(data, folder)


# ---- safetensors index --------------------------------------------------------------------------


def _stored_keys(folder: Path) -> dict[str, Path]:
    """Stored tensor key -> the safetensors file holding it."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError) as exc:
            raise UserError(f"{index}: not a safetensors index (no weight_map: {exc})") from None
        names = {str(v) for v in weight_map.values()}
        bad = sorted(n for n in names if "/" in n or "\\" in n or n.startswith(".") or not (folder / n).is_file())
        if bad:
            raise UserError(f"{index}: shard {bad[0]!r} is missing or outside the folder")
        return {str(k): folder / str(v) for k, v in weight_map.items()}
    path = folder / SINGLE_FILE
    if not path.is_file():
        raise UserError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are read; "
                        f"convert a pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {str(k): path for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise UserError(f"{path}: not a safetensors file ({exc})") from None


def open_hf_folder(path: str | Path) -> HfFolder:
    """Read and check a GPT-2 / Llama folder's config.json and tensor names (not the tensors).

    Raises:
        UserError (one line): not such a folder, an unsupported model type or config key (named),
        missing tensors, or tensors our model has no place for.
    """
    folder = Path(path).expanduser()
    if not (folder / HF_CONFIG).is_file():
        raise UserError(f"not a Hugging Face model folder: {folder} (no {HF_CONFIG})")
    c = _read_config(folder)
    model_type = c.data.get("model_type")
    if model_type == "gpt2":
        shape = _gpt2_shape(c)
    elif model_type == "llama":
        shape = _llama_shape(c)
    else:
        raise c.refuse("model_type", model_type, "gwtf imports gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)")
    if c.data.get("quantization_config") is not None:
        raise c.refuse("quantization_config", c.data["quantization_config"], "quantized weights are not read")
    family = str(shape["family"])
    tied = c.data.get("tie_word_embeddings", family == "gpt")
    if not isinstance(tied, bool):
        raise c.refuse("tie_word_embeddings", tied, "true or false is expected")
    files: dict[str, tuple[Path, str]] = {}
    for key, file in _stored_keys(folder).items():
        if _SKIPPED.search(key):
            continue
        files[key.removeprefix(_PREFIX[family])] = (file, key)
    eos = c.data.get("eos_token_id")
    hf = HfFolder(folder, family, shape, tied, files, eos if isinstance(eos, int) else None)
    plan = _plan(hf)
    missing = sorted({s for sources, _ in plan.values() for s in sources} - set(files))
    if missing:
        raise UserError(f"{folder}: tensor {missing[0]!r} of a {hf.architecture} is missing from its safetensors")
    used = {s for sources, _ in plan.values() for s in sources}
    extra = sorted(set(files) - used - ({"lm_head.weight"} if tied else set()))
    if extra:
        raise UserError(f"{folder}: tensor {files[extra[0]][1]!r} has no place in gwtf's {family} model "
                        f"(not a plain {hf.architecture}?)")
    return hf


# ---- tensors -> our names ----------------------------------------------------------------------

Plan = dict[str, tuple[tuple[str, ...], str]]  # our name -> (their names, "copy" | "t" | "cat")


def _gpt2_plan(hf: HfFolder) -> Plan:
    head = "lm_head.weight" if "lm_head.weight" in hf.files or not hf.tied else "wte.weight"
    plan: Plan = {
        "embedding.tokens.weight": (("wte.weight",), "copy"),
        "embedding.positions.weight": (("wpe.weight",), "copy"),
        "head.norm.weight": (("ln_f.weight",), "copy"), "head.norm.bias": (("ln_f.bias",), "copy"),
        "head.out.weight": ((head,), "copy"),
    }
    pairs = {"norm1": ("ln_1", False), "norm2": ("ln_2", False), "attn.qkv": ("attn.c_attn", True),
             "attn.proj": ("attn.c_proj", True), "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}
    for i in range(hf.shape["n_layer"]):
        for ours, (theirs, transpose) in pairs.items():
            plan[f"blocks.{i}.{ours}.weight"] = ((f"h.{i}.{theirs}.weight",), "t" if transpose else "copy")
            plan[f"blocks.{i}.{ours}.bias"] = ((f"h.{i}.{theirs}.bias",), "copy")
    return plan


def _llama_plan(hf: HfFolder) -> Plan:
    head = "lm_head.weight" if "lm_head.weight" in hf.files or not hf.tied else "embed_tokens.weight"
    plan: Plan = {
        "embedding.tokens.weight": (("embed_tokens.weight",), "copy"),
        "head.norm.weight": (("norm.weight",), "copy"),
        "head.out.weight": ((head,), "copy"),
    }
    for i in range(hf.shape["n_layer"]):
        ours, theirs = f"blocks.{i}.", f"layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        plan.update({
            ours + "norm1.weight": ((theirs + "input_layernorm.weight",), "copy"),
            ours + "norm2.weight": ((theirs + "post_attention_layernorm.weight",), "copy"),
            ours + "attn.qkv.weight": ((attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), "cat"),
            ours + "attn.proj.weight": ((attn + "o_proj.weight",), "copy"),
            ours + "mlp.gate_up.weight": ((mlp + "gate_proj.weight", mlp + "up_proj.weight"), "cat"),
            ours + "mlp.down.weight": ((mlp + "down_proj.weight",), "copy"),
        })
    return plan


def _plan(hf: HfFolder) -> Plan:
    return _gpt2_plan(hf) if hf.family == "gpt" else _llama_plan(hf)


def hf_tensors(hf: HfFolder, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Our parameters `names` (monolithic names; None: all) as contiguous float32 CPU tensors."""
    from safetensors import safe_open

    plan = _plan(hf)
    wanted = list(plan) if names is None else list(names)
    unknown = [n for n in wanted if n not in plan]
    if unknown:
        raise UserError(f"{hf.path}: gwtf parameter {unknown[0]!r} has no tensor in a {hf.architecture}")
    by_file: dict[Path, set[str]] = {}
    for name in wanted:
        for source in plan[name][0]:
            file, key = hf.files[source]
            by_file.setdefault(file, set()).add(key)
    raw: dict[str, Tensor] = {}
    for file, keys in sorted(by_file.items()):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in sorted(keys):
                    raw[key] = f.get_tensor(key)
        except Exception as exc:  # safetensors' own error types: a damaged or truncated shard
            raise UserError(f"{file}: cannot read its tensors ({exc})") from None
    out: dict[str, Tensor] = {}
    for name in wanted:
        sources, how = plan[name]
        parts = [raw[hf.files[s][1]].to(torch.float32) for s in sources]
        t = parts[0].t() if how == "t" else torch.cat(parts, dim=0) if how == "cat" else parts[0]
        t = t.contiguous()
        if any(t.data_ptr() == o.data_ptr() for o in out.values()):
            t = t.clone()  # a tied head: our head is an untied copy
        out[name] = t
    return out


# ---- the import ---------------------------------------------------------------------------------


def split_state(state: dict[str, Tensor], n_layer: int, stages: int) -> list[dict[str, Tensor]]:
    """Monolithic parameter names -> one dict per stage under stage-local names
    (`gwtf.model.stage`: stage 0 keeps embedding.* and head.*, relay k renumbers its blocks from 0)."""
    ranges = partition_layers(n_layer, stages)
    out: list[dict[str, Tensor]] = [{} for _ in range(stages)]
    for name, t in state.items():
        if not name.startswith("blocks."):
            out[0][name] = t
            continue
        _, i, rest = name.split(".", 2)
        k = next(s for s in range(1, stages) if int(i) in ranges[s])
        out[k][f"blocks.{int(i) - ranges[k].start}.{rest}"] = t
    return out


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What `import_hf_folder` wrote."""

    config: Config  # the recorded config: [model] shape keys, [data] tokenizer
    spec: ModelSpec
    architecture: str
    tokenizer: str | None  # the copied tokenizer folder, None when the source had no tokenizer.json
    params: int


def _copy_tokenizer(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in (TOKENIZER_JSON, *SIDE_FILES):
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)


def import_hf_folder(src: str | Path, out: str | Path) -> ImportResult:
    """Convert the GPT-2 / Llama folder `src` into a gwtf checkpoint at version 0 in `out`:
    out/checkpoint/ (`gwtf.model.checkpoint`, weights as `param.<stage-local name>`, no optimizer
    state), out/config.resolved.toml and out/tokenizer/ (the model's tokenizer files). [data]
    tokenizer points at out/tokenizer even when `src` has no tokenizer.json (the folder is then
    not made; a tokenizer.json put there later is found). Everything is read and checked before
    the first file is written."""
    from gwtf.model.checkpoint import save_checkpoint
    from gwtf.model.transformer import Transformer

    hf = open_hf_folder(src)
    out = Path(out)
    shape = {k: v for k, v in hf.shape.items() if k != "family"}
    model_cfg = ModelConfig(family=hf.family, preset="custom", stages=IMPORT_STAGES,  # type: ignore[arg-type]
                            seq_len=min(ModelConfig().seq_len, shape["max_positions"]), **shape)
    has_tokenizer = (hf.path / TOKENIZER_JSON).is_file()
    vocab = load_tokenizer_file(hf.path).vocab_size if has_tokenizer else model_cfg.vocab_size
    spec = model_spec(model_cfg, vocab)
    state = hf_tensors(hf)
    with torch.device("meta"):
        ref = Transformer(spec).state_dict()
    for name, t in state.items():
        if tuple(t.shape) != tuple(ref[name].shape):
            raise UserError(f"{hf.path}: tensor for {name} has shape {list(t.shape)}, config.json implies "
                            f"{list(ref[name].shape)}")
    tokenizer = (out / TOKENIZER_DIR).absolute()
    cfg = Config(model=model_cfg, data=DataConfig(tokenizer=str(tokenizer)))
    meta = {"config": to_dict(cfg), "elapsed_s": 0.0,
            "imported_from": {"path": str(hf.path.absolute()), "architecture": hf.architecture}}
    if has_tokenizer:
        _copy_tokenizer(hf.path, tokenizer)
    stages = [{f"param.{k}": v for k, v in part.items()}  # the trainer's naming (`gwtf.model.trainer`)
              for part in split_state(state, spec.n_layer, IMPORT_STAGES)]
    save_checkpoint(out / "checkpoint", 0, stages, {}, meta)
    write_resolved(cfg, out)
    return ImportResult(config=cfg, spec=spec, architecture=hf.architecture,
                        tokenizer=str(tokenizer) if has_tokenizer else None,
                        params=sum(t.numel() for t in state.values()))


def shape_of_spec(spec: ModelSpec) -> dict[str, Any]:
    """The ModelConfig shape keys that rebuild `spec` (the inverse of `model_spec`'s use of them)."""
    return {"family": spec.family, "n_layer": spec.n_layer, "d_model": spec.d_model, "n_head": spec.n_head,
            "n_kv_head": spec.n_kv_head, "d_ff": spec.d_ff, "vocab_size": spec.vocab_size,
            "max_positions": spec.seq_len, "rope_theta": spec.rope_theta, "norm_eps": spec.norm_eps}

