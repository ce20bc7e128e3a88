"""``SamplingModule``: the Lightning shell of a sampling run over several ranks (infer.py, the server).

Lightning is kept for what it does for these runs alone: it starts the ranks, builds the mesh through the ring
strategy, shards the model under FSDP, sets the precision, splits infer.py's requests over the data-parallel ranks
and stops every rank together on SIGTERM. The shell builds the model on that mesh (``configure_model``) and hands
every batch to its ``ringdit.sampling.Sampler``; it holds no sampling code and no training state (it is no
``DiffusionModule``). A sampling process of one rank needs no Lightning: ``ringdit.load`` builds the model and its
``Sampler`` directly.
"""

from __future__ import annotations

from typing import Any

import hydra
import lightning as L
from torch import nn

from ringdit.models.build import build_model
from ringdit.models.lora import lora_enabled
from ringdit.parallel import ParallelDims
from ringdit.sampling.sampler import Codecs, Sampler


def checkpoint_weights(spec) -> dict[str, Any]:
    """``build_model``'s weight keywords of a sampling run (a ``ringdit.spec.InferSpec``): the checkpoint's whole model,
    or an adapter-only LoRA checkpoint's base adapted as the run was (the adapters are loaded onto it once it is
    built, by ``ringdit.training.callbacks.LoadLoraAdapter``); none for a pipeline folder (``model.pretrained``
    holds its weights)."""
    if spec.pipeline:
        return {}
    if spec.lora is None:
        return {"init_from": spec.ckpt_path, "init_weights": spec.weights}
    return {"init_from": spec.lora.init_from, "init_weights": spec.lora.init_weights,
            "lora": spec.lora.settings if lora_enabled(spec.lora.settings) else None}


class SamplingModule(L.LightningModule):
    """Samples ``spec``'s model (a ``ringdit.spec.InferSpec``) on the ranks Lightning started; its ``sampler`` (made
    when prediction starts, on the rank's device) samples with ``step_cache`` (a ``ringdit.caching.StepCache``; None:
    every block runs) and guides away from ``negative`` (a text model's negative prompt's conditioning; None: the
    empty prompt) unless a request gives its own; ``codecs``: its text encoder and VAE (the server's rank 0)."""

    def __init__(self, spec, *, step_cache=None, negative: dict | None = None, codecs: Codecs = Codecs()):
        super().__init__()
        self.spec = spec
        self.model: nn.Module | None = None  # built in configure_model, on the strategy's mesh
        self.sampler: Sampler | None = None  # made in on_predict_start, once the model is on its device
        self._sampler_keywords = {"step_cache": step_cache, "negative": negative, "codecs": codecs}

    @property
    def parallel_dims(self) -> ParallelDims:
        """This rank's place in the mesh the strategy built (one process without a ringdit strategy)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return getattr(strategy, "parallel_dims", None) or ParallelDims()

    def configure_model(self) -> None:
        """Built here, not in __init__: the mesh exists only once the strategy set it up (``build_model``: the order
        of every step)."""
        if self.model is not None:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        self.model, _ = build_model(
            self.spec.model.config, dims=self.parallel_dims, backend=self.spec.layout.attention_backend,
            shard=getattr(strategy, "shard_model", None), offload_shards=getattr(strategy, "cpu_offload", False),
            **checkpoint_weights(self.spec))

    def on_predict_start(self) -> None:
        self.sampler = Sampler.for_run(self.model, hydra.utils.instantiate(self.spec.objective),
                                       self.spec.sampling, self.spec.data, dims=self.parallel_dims, device=self.device,
                                       **self._sampler_keywords)

    def predict_step(self, batch, batch_idx: int) -> dict:
        """A batch of ``ringdit.sampling.SampleRequests``, sampled by ``Sampler.sample_requests``."""
        return self.sampler.sample_requests(batch)
