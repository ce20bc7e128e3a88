"""``diffusion.model_guidance``: the guided target (Tang et al. 2025's model guidance) for a model with a guidance-scale
input -- the formula against a hand computation, the scale 1 as the plain loss, the same SGD steps (losses and weights)
on one process and on a ring of 2 in float64 for Flux-dev's tiny twin and the DiT; the DiT's guidance input, which a
checkpoint without it starts unchanged; one-line refusals before anything starts, whose advice works."""

from __future__ import annotations

import pytest
import torch

from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import sgd_steps
from tests.distributed import run_ranks
from tests.helpers import architecture, assert_same_numbers, prepare_train

DIT = {"_target_": "ringdit.models.DiT", "input_size": [8, 8], "patch_size": 2, "in_channels": 1, "hidden_size": 32,
       "depth": 2, "num_heads": 4, "num_classes": 10, "learn_sigma": False, "class_dropout_prob": 0.5,
       "guidance_embed": True}
FLUX = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "flux",
        "config": {**architecture("flux_tiny"), "guidance_embeds": True}, "input_size": [6, 6], "in_channels": 1,
        "text_len": 5, "text_dim": 32, "pooled_dim": 32, "condition_dropout_prob": 0.5, "guidance": 1.0}
RANGE = (1.0, 4.0)


def module(model_guidance, shape):
    from ringdit.training import DiffusionModule

    return DiffusionModule(model={}, objective={"_target_": "ringdit.diffusion.FlowMatching"},
                           data={"image_size": list(shape)}, sampling={"sampler": "euler", "steps": 2},
                           model_guidance=model_guidance)


def batch(kind: str):
    g = torch.Generator().manual_seed(5)
    if kind == "dit":
        return torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64), torch.tensor([1, 7, 3, 0])
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    return (torch.randn(2, 1, 6, 6, generator=g, dtype=torch.float64),
            {"text": torch.randn(2, 5, 32, generator=g, dtype=torch.float64) * mask[..., None], "text_mask": mask,
             "pooled": torch.randn(2, 32, generator=g, dtype=torch.float64)})


def built(kind: str, dims=None):
    from ringdit.models.build import build_model

    model, _ = build_model(DIT if kind == "dit" else FLUX, dims=dims, seed=3)
    model.double()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # adaLN-Zero and the guidance input start at zero output: perturb them, so that they act
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model


def test_the_target_is_the_guided_one_of_the_models_own_predictions():
    """For scales fixed at w, the loss is the mean squared distance to noise - x0 + (w - 1) (v(x_t, c, 1) -
    v(x_t, null, 1)), computed here by hand from the same draws (time, noise, condition drop, then the scale);
    at w = 1 it is the plain loss, bit for bit."""
    from ringdit.diffusion import draw_noise

    model = built("dit")
    x0, labels = batch("dit")
    plain = module(None, (8, 8)).diffusion_loss(model, x0, labels, [torch.Generator().manual_seed(i) for i in range(4)])
    at_one = module((1.0, 1.0), (8, 8)).diffusion_loss(model, x0, labels,
                                                       [torch.Generator().manual_seed(i) for i in range(4)])
    assert at_one.item() == plain.item()
    w = 3.0
    trained = module((w, w), (8, 8))
    loss = trained.diffusion_loss(model, x0, labels, [torch.Generator().manual_seed(i) for i in range(4)])
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    objective = trained.objective
    t = torch.cat([objective.sample_time(1, g, 16) for g in generators])
    noise = draw_noise(x0.shape[1:], generators, x0.device, x0.dtype)
    drop = torch.cat([torch.rand(1, generator=g) for g in generators]) < 0.5
    labels = torch.where(drop, torch.full_like(labels, 10), labels)
    x_t = objective.add_noise(x0, noise, t)
    time, ones = objective.model_time(t), torch.ones(4, dtype=torch.float64)
    with torch.no_grad():
        direction = model(x_t, time, labels, guidance=ones) - model(x_t, time, torch.full_like(labels, 10),
                                                                  guidance=ones)
    prediction = model(x_t, time, labels, guidance=torch.full((4,), w, dtype=torch.float64))
    expected = (prediction - (noise - x0) - (w - 1) * direction).square().mean()
    assert 0 < drop.sum() < 4  # both kinds of sample are in the batch
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.item() != pytest.approx(plain.item(), rel=1e-3)  # the guidance term is not nothing


def sgd(kind: str, dims=None):
    x0, condition = batch(kind)
    return sgd_steps(module(RANGE, x0.shape[2:]), built(kind, dims), x0, condition, 3, 0.5, average=dims is not None)


def check_ring(rank, world):
    for kind in ("dit", "flux"):
        ref_losses, ref_weights = sgd(kind)  # one process, in this rank
        losses, weights = sgd(kind, init_sequence_parallel(2, 1))
        # float64 weights; the loss's float32 casts (as train.py's) bound the agreement
        assert losses == pytest.approx(ref_losses, rel=1e-6), kind
        assert_same_numbers(weights, ref_weights, atol=1e-6, where=kind)
        assert any("g_embedder" in key or "guidance_embedder" in key for key in weights)


def test_sgd_steps_equal_one_process_and_ring_2_in_float64():
    """3 SGD steps at lr 0.5 with scales drawn in [1, 4] (the two reference forwards too under the ring): the same
    losses and weights as one process, for Flux-dev's tiny twin (9 image tokens: padded on 2 ranks) and the DiT."""
    run_ranks(check_ring, 2)


def test_a_dit_checkpoint_without_a_guidance_input_starts_the_model_unchanged(tmp_path):
    """init_from a DiT trained without ``guidance_embed``: the guidance embedder starts at its initial value (zero
    output), so the model predicts what the file's model does, at every scale."""
    from ringdit.models.build import build_model

    base, _ = build_model({**DIT, "guidance_embed": False}, seed=1)
    torch.save({"state_dict": {f"model.{k}": v for k, v in base.state_dict().items()}}, tmp_path / "base.ckpt")
    model, _ = build_model(DIT, init_from=str(tmp_path / "base.ckpt"), init_weights="model", seed=2)
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([100.0, 900.0]), torch.tensor([2, 10])
    for scale in (1.0, 4.5):
        out = model(x, t, y, guidance=torch.full((2,), scale))
        torch.testing.assert_close(out, base(x, t, y), rtol=0, atol=0)


DIGITS = ["data.batch_size=8", "trainer.max_steps=1", "logger=csv"]


@pytest.mark.parametrize("overrides, message", [
    (["diffusion.model_guidance=[1,4]"], r"diffusion.model_guidance=\[1, 4\] trains a model's guidance-scale "
                                          r"input, but this DiT has none.*model.guidance_embed=true"),
    (["model.guidance_embed=true", "diffusion.model_guidance=[0.5,4]"], r"is not a range of guidance scales"),
    (["model.guidance_embed=true", "diffusion.model_guidance=[4,2]"], r"1 <= low <= high"),
    (["model.guidance_embed=true", "diffusion.model_guidance=3"], r"is not a range of guidance scales"),
    (["model.guidance_embed=true", "model.class_dropout_prob=0", "diffusion.model_guidance=[1,4]"],
     r"drop probability is 0; set model.class_dropout_prob"),
])
def test_refused_before_anything_starts(tmp_path, overrides, message):
    refused(tmp_path, [*DIGITS, *overrides], message)


def refused(tmp_path, overrides: list[str], message: str) -> None:
    """train.py's checks refuse ``overrides`` with ``message`` (a regex) in one line, and nothing is written."""
    import re

    from hydra.errors import InstantiationException

    with pytest.raises((ValueError, InstantiationException)) as raised:
        prepare_train(overrides, tmp_path / "run")
    assert "\n" not in str(raised.value) and re.search(message, str(raised.value)), raised.value
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_refused_with_distillation_and_the_advice_works(tmp_path):
    """With distill= it is refused; the advice (a model with a guidance input) makes the run valid."""
    teacher = tmp_path / "teacher.ckpt"
    from ringdit.models.build import build_model

    model, _ = build_model({**DIT, "hidden_size": 128, "depth": 6, "class_dropout_prob": 0.1}, seed=1)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, teacher)
    refused(tmp_path / "a", [*DIGITS, "model.guidance_embed=true", "distill=dmd2",
                                                    f"init_from={teacher}", "diffusion.model_guidance=[1,4]"],
                                   r"distill=dmd2 trains with its own losses; set diffusion.model_guidance=null")
    assert prepare_train([*DIGITS, "model.guidance_embed=true", "diffusion.model_guidance=[1,4]"], tmp_path / "run")


def test_a_guidance_scale_the_dit_would_not_be_fed_is_refused():
    """infer.py's model.guidance reaches a text model's conditioning, not the DiT: a DiT with a guidance input samples
    at the scale its run recorded, and another one is refused in one line (the same one passes)."""
    from ringdit.common.errors import ConfigError
    from ringdit.models import DiT

    config = {"guidance_embed": True, "guidance": 2.0, "class_dropout_prob": 0.1}
    DiT.check_guidance(config, {"guidance": 2.0})
    with pytest.raises(ConfigError, match=r"model.guidance=3.0: a DiT with a guidance input samples at the scale its "
                                          r"run recorded, model.guidance=2; leave it unset"):
        DiT.check_guidance(config, {"guidance": 3.0})
    with pytest.raises(ConfigError, match="the DiT has none"):
        DiT.check_guidance({"class_dropout_prob": 0.1}, {"guidance": 3.0})


@pytest.mark.parametrize("value", ["-3", "nan", "inf"])
def test_a_guidance_scale_below_zero_or_not_finite_is_refused_and_the_advice_trains(tmp_path, value):
    """model.guidance is the scale a guidance embedding is fed (the DiT's, Flux-dev's): a negative or non-finite one
    is refused in one line naming it, for the DiT at train time and for any model at sampling time; the advised
    scales build."""
    from ringdit.common.errors import ConfigError
    from ringdit.models.diffusers import DiffusersTransformer

    message = rf"model.guidance={value}.* must be a finite number >= 0, e.g. model.guidance=3.5"
    refused(tmp_path, [*DIGITS, "model.guidance_embed=true", f"model.guidance={value}"], message)
    with pytest.raises(ConfigError, match=rf"model.guidance={float(value)!r}.* a finite number >= 0"):  # infer.py's
        DiffusersTransformer.check_guidance({"family": "flux", "config": {"guidance_embeds": True}},
                                            {"guidance": float(value)})
    assert prepare_train([*DIGITS, "model.guidance_embed=true", "model.guidance=3.5"], tmp_path / "advised")
