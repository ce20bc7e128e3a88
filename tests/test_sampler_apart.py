"""Sampling lives apart from training: the training module has no sampling method, and the sampling runs' modules
(infer.py's and the server's Lightning shell, distillation's teacher) hold a ``Sampler`` rather than inheriting one."""

from __future__ import annotations

import inspect
import re

import lightning as L

from ringdit.sampling.predict import SamplingModule
from ringdit.training import DiffusionModule, DistillationModule

SAMPLING_NAME = re.compile(r"sampl|generate|predict|pipeline|decode|pixels|encode")
# what the training module held for sampling until 2026-12-06: each moved to the Sampler or the SamplingModule
MOVED = ("for_sampling", "sampler", "generate", "predict_step", "samples_are_pixels", "sampling_model",
         "sampling_weights", "pipeline")


def own_public_names(cls) -> set[str]:
    """The public attributes ``cls`` defines or overrides below ``LightningModule``."""
    names = set()
    for klass in cls.__mro__:
        if klass is L.LightningModule:
            break
        names |= {name for name in vars(klass) if not name.startswith("_")}
    return names


def test_the_training_module_only_trains():
    """No method or attribute of DiffusionModule (nor of the distillation module that extends it) names sampling:
    what it had moved to the Sampler (infer.py's and the server's to the SamplingModule)."""
    for cls in (DiffusionModule, DistillationModule):
        assert not own_public_names(cls) & set(MOVED), cls
        sampling = sorted(name for name in own_public_names(cls) if SAMPLING_NAME.search(name))
        assert sampling == [], f"{cls.__name__} samples: {sampling}"
    module = DiffusionModule(model={}, objective={"_target_": "ringdit.diffusion.FlowMatching"}, data={})
    assert not [name for name in vars(module) if SAMPLING_NAME.search(name)]  # no sampling state either


def test_the_sampling_modules_are_no_training_modules():
    """infer.py's and the server's Lightning shell inherits nothing from the training module, and samples only
    through its Sampler (its predict step is one call)."""
    # here, not at the top: importing the ringdit.serve package rebinds ``ringdit.serve`` (the Python API's function)
    # to it, which test_python_api's parameters read when they are collected
    from ringdit.serve.engine import ServingModule

    for cls in (SamplingModule, ServingModule):
        assert not issubclass(cls, DiffusionModule), cls
    assert own_public_names(SamplingModule) == {"parallel_dims", "configure_model", "on_predict_start", "predict_step"}
    source = inspect.getsource(SamplingModule.predict_step)
    assert "self.sampler.sample_requests(batch)" in source


def test_distillation_holds_its_teachers_sampler():
    """The teacher samples through a Sampler the module holds (made when training starts), not an inherited method."""
    source = inspect.getsource(DistillationModule)
    assert "self.teacher_sampler = Sampler.for_run(self.teacher" in source
    assert "teacher_sampler()" not in source
