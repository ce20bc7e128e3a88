"""The sampling side: the ``Sampler`` (a model, its ranks, its ``SamplingPipeline`` and its ``Codecs``: what
generating needs, apart from training -- prompts to conditions, denoising, latents to pixels); ``ringdit.load``'s
resident sampler (``resident``); infer.py's and the server's Lightning shell (``predict.SamplingModule``); sampling
jobs for ``infer.py``: which samples to draw and at which shape (``SampleSizes``: ``size=[H, W]`` / ``frames=N`` to
the data's cells; ``read_prompt_file``), batches of one shape each (``ShapeBatches``), and collecting the samples
from every rank into files (``SampleWriter``: one set of files per shape when the shapes differ; ``decoding``: the
run's codecs, their pictures and videos, with the sound a model samples beside them)."""

from ringdit.sampling.requests import (PROMPT_KEYS, PROMPT_LINE, PromptLine, SampleRequests, ShapeBatches,
                                       read_prompt_file, resolve_labels)
from ringdit.sampling.sampler import Codecs, Sampler
from ringdit.sampling.sizes import FPS_HINT, SampleSizes, Shape, frame_rate, patch_shape, size_pair
from ringdit.sampling.writer import SampleWriter, write_pixels, write_sample

__all__ = [
    "Codecs", "FPS_HINT", "PROMPT_KEYS", "PROMPT_LINE", "PromptLine", "SampleRequests", "SampleSizes", "Sampler",
    "SampleWriter", "Shape", "ShapeBatches", "frame_rate", "patch_shape", "read_prompt_file", "resolve_labels", "size_pair",
    "write_pixels", "write_sample",
]
