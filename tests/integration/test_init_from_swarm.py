"""A churn-free swarm started from an imported Hugging Face Llama (`model.init_from`) trains
exactly like `gwtf train --local` from the same import: per-iteration loss within rtol 1e-5, the
tolerance of test_swarm_equivalence (float32 summation order only). The node processes resolve
init_from themselves (shape, vocabulary) and build their stages from its weights."""

from __future__ import annotations

import io
from collections.abc import Callable
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import pytest
import torch

from gwtf.config import load_config
from gwtf.model.hf_import import import_hf_folder
from gwtf.model.trainer import train_local
from gwtf.runtime.swarm import Swarm

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")


def _tiny_llama(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with redirect_stderr(io.StringIO()):
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="20KB")


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_swarm_from_an_import_matches_the_local_trainer(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]], tmp_path: Path
) -> None:
    _tiny_llama(tmp_path / "hf")
    import_hf_folder(tmp_path / "hf", tmp_path / "imported")
    overrides = (f'model.init_from="{tmp_path / "imported"}"', "model.stages=2", "train.iterations=4")
    swarm = make_swarm(overrides)
    swarm.start()
    totals = finish(swarm, 4, 100)
    swarm.close()
    got = [r["loss"] for r in swarm.metrics.rows[:4]]
    assert totals["expected"] == 4 * 4 * 2
    torch.set_num_threads(1)
    local = train_local(load_config(CONFIG, list(overrides)), tmp_path / "local")
    np.testing.assert_allclose(got, [m["loss"] for m in local.metrics], rtol=1e-5, atol=0)
