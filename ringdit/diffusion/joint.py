"""``JointLatents``: latents a model denoises together with the video (LTX-2's audio, ``Family.joint_latents``) sampled
by the same sampler as one flat state per sample.

Every sampler ringdit has -- Euler / Heun on flow times, DDIM, DDPM, the diffusers schedulers -- updates its state
elementwise from the prediction (and guidance combines predictions linearly), so stepping the video and the audio
packed side by side in one ``(B, N_video + N_audio)`` tensor is stepping each on its own with the same times, as
``LTX2Pipeline`` steps a copy of its scheduler for the audio. The model sees them apart: ``model`` unpacks the state,
hands the joint latents over in the conditioning and packs both predictions back. A sampler that steps each stream
on a schedule of its own (``sample_with_scheduler``'s ``streams``: MiniMax-H3's audio at shift 3 beside its video at
12) gives a time per stream, which the model gets as each joint latent's ``<key>_time``.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


class JointLatents:
    """The packing of video latents ``(B, *video)`` and joint latents ``{key: (B, *shape)}`` into ``(B, N)``."""

    def __init__(self, video: tuple[int, ...], joint: dict[str, tuple[int, ...]]):
        self.shapes = {None: tuple(video), **{key: tuple(shape) for key, shape in joint.items()}}
        self.sizes = [math.prod(shape) for shape in self.shapes.values()]

    def pack(self, video: Tensor, joint: dict[str, Tensor]) -> Tensor:
        """(B, *video), {key: (B, *shape)} -> (B, N)."""
        return torch.cat([video.flatten(1), *(joint[key].flatten(1) for key in self.shapes if key is not None)], 1)

    def unpack(self, state: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(B, N) -> the video (B, *video) and {key: (B, *shape)}."""
        parts = state.split(self.sizes, dim=1)
        video, *joint = (part.reshape(state.shape[0], *shape) for part, shape in zip(parts, self.shapes.values()))
        return video, dict(zip([key for key in self.shapes if key is not None], joint))

    def model(self, model):
        """``model(x, t, cond) -> (prediction, {key: prediction})`` as a model of the packed state (B, N), at times t
        (B,) for all streams or (B, 1 + joint streams) one per stream."""

        def packed(state: Tensor, t: Tensor, condition: dict) -> Tensor:
            video, joint = self.unpack(state)
            if t.dim() == 2:  # (B, 1 + joint streams): the video's time, then each joint latent's (e.g. audio_time)
                keys = [key for key in self.shapes if key is not None]
                t, condition = t[:, 0], {**condition, **{f"{key}_time": t[:, 1 + i] for i, key in enumerate(keys)}}
            prediction, joint_predictions = model(video, t, {**condition, **joint})
            return self.pack(prediction, joint_predictions)

        return packed
