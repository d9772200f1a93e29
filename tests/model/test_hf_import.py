"""`gwtf import`, `model.init_from`, tokenizers from files and `gwtf eval`, checked against
`transformers` itself on a GPT-2 and a Llama made here from small random configs (CPU, seconds).

The weights are perturbed away from transformers' N(0, 0.02) init (norm gains and biases too,
by N(0, 0.1)), so logits reach magnitude ~2-3 and a wrong mapping (a missing transpose, q/k/v in
the wrong order, the wrong RoPE base or epsilon) shows. Measured: max |logit difference| ~1e-6
(float32 kernels); the tolerance is the issue's 1e-5. (With N(0, 0.3) the Llama differs by 2.4e-5
on 64 positions: transformers computes the RoPE angles in float32, we in float64 then cast; with
its float32 tables ours differ by 3e-6.) The Llama is saved sharded (max_shard_size) with a
non-default rope_theta and rms_norm_eps and an untied head; the GPT-2 with transformers' default
tied head (no lm_head.weight stored).
"""

from __future__ import annotations

import io
import json
import random
import shutil
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gwtf.cli import main
from gwtf.commands.trained import load_trained
from gwtf.config import DataConfig
from gwtf.errors import UserError
from gwtf.model.hf_import import import_hf_folder
from gwtf.model.tokenizer import FileTokenizer, cache_key, load_or_train_tokenizer, vocab_size_for

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

LOGIT_TOL = 1e-5
VOCAB = 300


def _texts() -> list[str]:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(200)]
    return [" ".join(rng.choice(words) for _ in range(30)) + "." for _ in range(300)]


def _tokenizer(folder: Path, specials: list[str], eos_in_config: str | None) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    if eos_in_config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos_in_config},
                                                                  "bos_token": "<s>"}))


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def _gpt2(folder: Path) -> None:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    _perturb(model, 1)
    model.save_pretrained(folder)
    _tokenizer(folder, ["<|endoftext|>"], None)


def _llama(folder: Path) -> None:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg)
    _perturb(model, 2)
    model.save_pretrained(folder, max_shard_size="20KB")
    _tokenizer(folder, ["<s>", "</s>"], "</s>")


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {"gpt": root / "gpt2", "llama": root / "llama"}
    with redirect_stderr(io.StringIO()):  # transformers' progress bars
        _gpt2(out["gpt"])
        _llama(out["llama"])
    (root / "corpus.txt").write_text("\n".join(_texts()), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def imported(hf: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imported")
    for family, folder in hf.items():
        import_hf_folder(folder, root / family)
    return {family: root / family for family in hf}


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _hf_model(folder: Path) -> Any:
    with redirect_stderr(io.StringIO()):
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_imported_logits_equal_transformers(family: str, hf: dict[str, Path], imported: dict[str, Path]) -> None:
    model = load_trained(imported[family]).model
    ref = _hf_model(hf[family])
    tokens = torch.randint(0, VOCAB, (2, model.spec.seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(tokens), ref(tokens).logits
    assert isinstance(ours, torch.Tensor) and theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= LOGIT_TOL


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_import_then_export_gives_the_same_tensors(family: str, hf: dict[str, Path], imported: dict[str, Path],
                                                   tmp_path: Path) -> None:
    if family == "llama":
        assert (hf[family] / "model.safetensors.index.json").is_file()
        assert len(list(hf[family].glob("model-*-of-*.safetensors"))) >= 2
    rc, _, err = _cli("export", "--checkpoint", str(imported[family]), "--out", str(tmp_path / "x"))
    assert rc == 0, err
    before, after = _hf_tensors(hf[family]), load_file(str(tmp_path / "x" / "model.safetensors"))
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    extra = set(after) - set(before)
    if family == "gpt":  # the tied head, exported untied: a copy of the embedding
        assert extra == {"lm_head.weight"}
        assert torch.equal(after["lm_head.weight"], before["transformer.wte.weight"])
    else:
        assert extra == set()
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    source = json.loads((hf[family] / "config.json").read_text())
    keys = ("n_positions", "n_embd", "layer_norm_epsilon") if family == "gpt" else (
        "max_position_embeddings", "num_key_value_heads", "rms_norm_eps", "intermediate_size")
    assert {k: config[k] for k in keys} == {k: source[k] for k in keys}
    tok = json.loads((tmp_path / "x" / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == ({"content": "</s>"} if family == "llama" else "<|endoftext|>")


def _eval_loss(*argv: str) -> float:
    rc, out, err = _cli("eval", *argv, "--json")
    assert rc == 0, err
    return float(json.loads(out)["loss"])


def test_train_from_an_import_starts_at_the_loss_eval_reports(
        hf: dict[str, Path], imported: dict[str, Path], tmp_path: Path) -> None:
    corpus = str(hf["llama"].parent / "corpus.txt")
    cache = f'data.cache_dir="{tmp_path / "cache"}"'
    want = _eval_loss("--checkpoint", str(imported["llama"]), "--data", corpus, "--set", cache)
    assert want == _eval_loss("--checkpoint", str(hf["llama"]), "--data", corpus, "--set", cache)
    run = tmp_path / "run"
    rc, _, err = _cli("train", "--local", "--out", str(run), "--iterations", "2", "--set",
                      f'model.init_from="{imported["llama"]}"', "--set", f'data.source="{corpus}"', "--set", cache,
                      "--set", "train.torch_threads=1", "--set", "train.eval_every=0")
    assert rc == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["val_loss_start"] == want
    assert abs(rows[0]["loss"] - want) < 0.5  # the training windows' loss of the same weights
    rc, out, err = _cli("generate", "--checkpoint", str(run), "--prompt", "ab", "--max-new-tokens", "4",
                        "--temperature", "0")
    assert rc == 0 and out.startswith("ab"), err


def test_init_from_gives_the_shape_and_a_conflicting_key_is_one_line(imported: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    from gwtf.config import Config, ModelConfig
    from gwtf.model.pretrained import resolve_init

    cfg = resolve_init(Config(model=ModelConfig(init_from=str(imported["llama"]))))
    m = cfg.model
    assert (m.family, m.preset, m.n_layer, m.d_model, m.n_kv_head, m.d_ff, m.rope_theta) == (
        "llama", "custom", 3, 32, 2, 48, 500.0)
    assert m.seq_len == 64 and cfg.data.tokenizer == str(imported["llama"] / "tokenizer")
    assert resolve_init(cfg) == cfg
    rc, _, err = _cli("train", "--local", "--out", str(tmp_path / "r"), "--set",
                      f'model.init_from="{imported["llama"]}"', "--set", "model.d_model=64")
    assert rc == 2 and err.count("\n") == 1 and "model.d_model = 64 conflicts" in err, err
    rc, _, err = _cli("train", "--local", "--out", str(tmp_path / "r"), "--set",
                      f'model.init_from="{tmp_path / "nowhere"}"')
    assert rc == 2 and err.count("\n") == 1 and "no such file" in err, err


def _edited_copy(src: Path, dest: Path, **changes: Any) -> Path:
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(("family", "changes", "key"), [
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("gpt", {"activation_function": "gelu"}, "activation_function"),
    ("gpt", {"model_type": "mistral"}, "model_type"),
])
def test_an_unsupported_config_key_is_refused_naming_it(family: str, changes: dict[str, Any], key: str,
                                                        hf: dict[str, Path], tmp_path: Path) -> None:
    folder = _edited_copy(hf[family], tmp_path / "src", **changes)
    rc, _, err = _cli("import", "--hf", str(folder), "--out", str(tmp_path / "out"))
    assert rc == 2 and err.count("\n") == 1 and f"{key} = " in err and "not supported" in err, err
    assert not (tmp_path / "out").exists()


def test_bad_paths_are_one_line_and_exit_2(hf: dict[str, Path], tmp_path: Path) -> None:
    for argv in (("import", "--hf", str(tmp_path / "none"), "--out", str(tmp_path / "o")),
                 ("import", "--hf", str(tmp_path), "--out", str(tmp_path / "o")),
                 ("eval", "--checkpoint", str(tmp_path / "none")),
                 ("eval", "--checkpoint", str(hf["gpt"]), "--data", str(tmp_path / "none.txt"))):
        rc, _, err = _cli(*argv)
        assert rc == 2 and err.count("\n") == 1 and err.startswith("gwtf: error: "), (argv, err)


def test_tokenizer_from_a_file_or_folder(hf: dict[str, Path], tmp_path: Path) -> None:
    llama = DataConfig(tokenizer=str(hf["llama"]))
    tok = load_or_train_tokenizer(llama, [], "", tmp_path)
    assert isinstance(tok, FileTokenizer) and tok.eot_token == "</s>" and tok.vocab_size == 290
    assert tok.eot_id == Tokenizer.from_file(str(hf["llama"] / "tokenizer.json")).token_to_id("</s>")
    text = _texts()[0]
    assert tok.decode(tok.encode(text)) == text and tok.encode_many([text, "ab"])[0] == tok.encode(text)
    gpt = DataConfig(tokenizer=str(hf["gpt"] / "tokenizer.json"))  # a file; no tokenizer_config.json
    assert vocab_size_for(gpt) == 290
    key = cache_key(gpt)
    assert key.startswith("file-") and key.endswith("-e0") and key != cache_key(llama)
    bare = tmp_path / "bare"
    bare.mkdir()
    _tokenizer(bare, ["<pad>"], None)  # no end-of-text token anywhere
    for bad in (str(bare), str(tmp_path / "missing.json")):
        with pytest.raises(UserError, match="tokenizer"):
            vocab_size_for(DataConfig(tokenizer=bad))


def test_the_tensor_simulator_starts_from_an_import(hf: dict[str, Path], imported: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """Real tensors under the simulator (`tensor_sim`) from `model.init_from`: the imported shape and
    weights, equal to `gwtf train --local`'s iterations from the same import (float64, 1e-12)."""
    from gwtf.config import load_config
    from gwtf.model.data import load_dataset
    from gwtf.sim.scenario import build, load_scenario
    from gwtf.tensor_sim import compare_stages, config_for, reference_stages, run_with_tensors

    sc = load_scenario(None, ['model.preset="tiny"', "model.seq_len=16", "model.microbatch_size=2", "model.stages=2",
                              "nodes.count=4", "nodes.data_holders=2", "nodes.relay_capacity=[1, 3]",
                              "train.iterations=2", "train.microbatches=2", "sim.max_time_s=1500.0",
                              'wire.activations="fp32"', 'wire.gradients="fp32"', 'wire.stage_gradients="fp32"',
                              'protocol.reduce="gather"'])
    corpus = hf["gpt"].parent / "corpus.txt"
    base = load_config(None, [f'model.init_from="{imported["gpt"]}"', f'data.source="{corpus}"',
                              f'data.cache_dir="{tmp_path / "cache"}"'])
    cfg = config_for(sc, base)
    assert (cfg.model.preset, cfg.model.d_model, cfg.model.n_layer, cfg.model.stages) == ("custom", 32, 2, 2)
    ds = load_dataset(cfg.data, cfg.model, cfg.train.seed, cfg.train.data_holders, microbatches=cfg.train.microbatches,
                      say=lambda _: None)
    assert ds.vocab_size <= VOCAB  # the import's own tokenizer, not a BPE trained here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want, losses = reference_stages(cfg, ds, 2)
        run = run_with_tensors(sc, 0, cfg, ds, built=build(sc, 0))
        seeded, _ = reference_stages(replace(cfg, model=replace(cfg.model, init_from="")), ds, 2)
    finally:
        torch.set_num_threads(threads)
    assert run.summary["finished"] and run.weights
    for node, weights in run.weights.items():
        d_abs, d_rel = compare_stages(weights, want[run.stage_of[node]])
        assert d_abs <= 1e-12 and d_rel <= 1e-9, (node, d_abs, d_rel)
    assert abs(run.losses[0][0] - losses[0]) < 1.0 and compare_stages(want[0], seeded[0])[0] > 1e-3
