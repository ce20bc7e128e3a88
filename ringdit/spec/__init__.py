"""The run spec: a composed Hydra config checked once, before any process is spawned, into frozen dataclasses that
the code downstream takes and trusts (torchtitan's validated job config). One module per part:

- ``layout``: ``Layout`` (defined in ``ringdit.parallel.layout``, which the memory estimate imports) -- dp x ring x ulysses
  ranks on devices x nodes, device type, attention backend, the strategy (ddp | fsdp, from its class) and how it
  shards; launches whose ranks would never come;
- ``model``: ``ModelSpec`` -- the model config shaped by the data, built on the meta device to check it;
- ``diffusion``: the objective's resolution shift; samplers, steps and guidance that fit objective and model;
- ``optimizer``: ``OptimizerSpec`` -- optimizer and scheduler partials, EMA decay;
- ``trainer``: ``TrainerSpec`` -- Lightning's settings, callbacks, loggers;
- ``distill``: ``DistillSpec`` -- a distillation's student, critic and teacher settings (``distill=dmd2``);
- ``checkpoint``: ``CheckpointPlan`` -- resume, init_from, LoRA; the weights files inspected against the model;
- ``train`` / ``infer``: ``TrainSpec`` / ``InferSpec``, composed of the parts, for train.py / infer.py.
"""

from ringdit.spec.checkpoint import CheckpointPlan
from ringdit.spec.diffusion import check_sampling, resolve_shift
from ringdit.spec.distill import DistillSpec
from ringdit.spec.infer import Conditioning, InferSpec, OutputSpec
from ringdit.parallel.layout import Layout
from ringdit.spec.model import ModelSpec, build_on_meta, model_config
from ringdit.spec.optimizer import OptimizerSpec
from ringdit.spec.train import DataSpec, TrainSpec
from ringdit.spec.trainer import TrainerSpec

__all__ = [
    "CheckpointPlan",
    "Conditioning",
    "DataSpec",
    "DistillSpec",
    "InferSpec",
    "Layout",
    "ModelSpec",
    "OptimizerSpec",
    "OutputSpec",
    "TrainSpec",
    "TrainerSpec",
    "build_on_meta",
    "check_sampling",
    "model_config",
    "resolve_shift",
]
