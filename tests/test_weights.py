"""init_from with every weight format, label-table resizing, export to safetensors and sampling from the export."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from ringdit.checkpoints.fit import LABEL_TABLE, load_model_weights, resize_label_embedding
from ringdit.checkpoints.weights import read_weights
from ringdit.common.errors import CheckpointError
from ringdit.models import DiT, parallelize
from tests.helpers import TINY, fail_fast, in_process, original_dit_state_dict_shapes, run

ZERO_LR = ["optimizer=sgd", "optimizer.lr=0.0", "trainer.max_steps=1", "scheduler=constant"]


def tiny_model(**overrides) -> DiT:
    config = dict(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=4, num_classes=10,
                  learn_sigma=False)
    return parallelize(DiT(**{**config, **overrides}), backend="math")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short real run: its last.ckpt has distinct model and EMA weights."""
    run_dir = tmp_path_factory.mktemp("trained")
    run("train.py", run_dir, *TINY, "trainer.max_steps=3", "ema_decay=0.5")
    return run_dir / "checkpoints" / "last.ckpt"


def final_model_weights(run_dir) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, msg=key)


@pytest.mark.parametrize("weights", ["ema", "model"])
def test_init_from_a_ringdit_checkpoint(trained, weights, tmp_path):
    expected, _ = read_weights(trained, prefer=weights)
    run("train.py", tmp_path, *TINY, *ZERO_LR, f"init_from={trained}", f"init_weights={weights}")
    assert_same_weights(final_model_weights(tmp_path), expected)  # lr 0: the run kept what it loaded


def test_export_then_init_from_and_infer(trained, tmp_path):
    export = tmp_path / "weights.safetensors"
    proc, _ = in_process("-m ringdit.export", f"ckpt_path={trained}", f"out={export}")
    assert proc.returncode == 0, proc.stderr
    state, info = read_weights(export)
    assert_same_weights(state, read_weights(trained, prefer="ema")[0])
    assert info["model"]["hidden_size"] == 32 and info["data"]["num_classes"] == 10

    run("train.py", tmp_path / "finetune", *TINY, *ZERO_LR, f"init_from={export}")
    assert_same_weights(final_model_weights(tmp_path / "finetune"), state)

    samples = {}
    for name, path in {"ckpt": trained, "export": export}.items():
        run("infer.py", tmp_path / name, f"ckpt_path={path}", "num_samples=4", "diffusion.sampling.steps=3")
        samples[name] = np.load(tmp_path / name / "samples.npz")["images"]
    np.testing.assert_array_equal(samples["export"], samples["ckpt"])


def test_init_from_an_original_dit_state_dict(tmp_path):
    """A bare state dict with facebookresearch/DiT's names and shapes (its released .pt files), and its training
    checkpoint layout {"model", "ema", "opt", "args"}."""
    shapes = original_dit_state_dict_shapes(depth=2, hidden=32, heads=4, patch=2, input_size=8, in_channels=1,
                                            num_classes=10)
    generator = torch.Generator().manual_seed(0)
    state = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    bare, training = tmp_path / "DiT-tiny.pt", tmp_path / "0001000.pt"
    torch.save(state, bare)
    args = argparse.Namespace(model="DiT-XL/2", image_size=256, num_classes=1000)  # as its train.py saves them
    torch.save({"model": {k: v + 1 for k, v in state.items()}, "ema": state, "opt": {}, "args": args}, training)
    learn_sigma = ["model.learn_sigma=true"]  # original checkpoints predict the variance too
    for name, path in {"bare": bare, "training": training}.items():
        run("train.py", tmp_path / name, *TINY, *ZERO_LR, *learn_sigma, f"init_from={path}")
        assert_same_weights(final_model_weights(tmp_path / name), state)


def test_init_from_a_different_model_is_refused_clearly(trained, tmp_path):
    proc, _ = fail_fast("train.py", *TINY, "model.hidden_size=64", f"init_from={trained}", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert "init_from: init_from=" in proc.stderr and "does not fit this model" in proc.stderr
    assert "x_embedder.proj.weight (32, 1, 2, 2) vs (64, 1, 2, 2)" in proc.stderr


def test_label_table_resizing_keeps_shared_classes_and_the_null_row():
    source = tiny_model(num_classes=10)
    target = tiny_model(num_classes=12)
    state = source.state_dict()
    with pytest.raises(CheckpointError, match=r"y_embedder.embedding_table.weight \(11, 32\) vs \(13, 32\)"):
        from ringdit.checkpoints.fit import check_compatible

        check_compatible(target, state)
    resized = resize_label_embedding(state, rows=13, generator=torch.Generator().manual_seed(0))
    table, old = resized[LABEL_TABLE], state[LABEL_TABLE]
    torch.testing.assert_close(table[:10], old[:10])
    torch.testing.assert_close(table[-1], old[-1])  # the null class of classifier-free guidance
    assert table[10:12].std() < 0.1
    smaller = resize_label_embedding(state, rows=6)[LABEL_TABLE]
    torch.testing.assert_close(smaller[:5], old[:5])
    torch.testing.assert_close(smaller[-1], old[-1])


def test_load_model_weights_with_resized_labels(tmp_path):
    source = tiny_model(num_classes=10)
    path = tmp_path / "w.pt"
    torch.save(source.state_dict(), path)
    target = tiny_model(num_classes=3)
    with pytest.raises(CheckpointError):
        load_model_weights(target, path)
    load_model_weights(target, path, resize_labels=True)
    torch.testing.assert_close(target.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
