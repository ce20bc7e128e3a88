"""The video frame counts a model (and the VAE its data were encoded with) takes: one rule, one message.

A causal video VAE keeps the first frame alone and folds every ``temporal`` frames after it into one latent frame
(1 + k x temporal frames: Wan, HunyuanVideo, LTX 4 or 8); a VAE whose latents are padded at the front to a multiple
of ``pad`` frames, which decoding drops again (CogVideoX 1.5: 2, its transformer's temporal patch), takes only the
counts whose latent count is 1 more than a multiple of ``pad`` (1 + 8k); and the transformer's temporal ``patch``
must divide the latent frames it is given. Without a video VAE (``temporal`` 1) the frames are the model's cells.

A VAE that encodes in chunks (``chunk``: AutoencoderKLMiniMaxH3, 17 frames per chunk, each ``chunk_latents`` 5 latent
frames, ``chunk_drop`` 3 dropped at the end) takes the counts its pipeline snaps to: ``chunk`` x n + ``chunk_latents``
frames (17n + 5), which give (n + 1) x ``chunk_latents`` - ``chunk_drop`` latent frames (5n + 2; the modular
pipeline's align_num_frames / video_latent_num_frames) -- no single temporal factor describes that rhythm."""

from __future__ import annotations

from dataclasses import dataclass

from ringdit.common.errors import ConfigError

SEARCH = 4096  # how far from a refused count the nearest valid ones are looked for (frames)


@dataclass(frozen=True)
class FrameRule:
    temporal: int = 1  # video frames per latent frame after the first (the VAE's temporal compression); 1: none
    pad: int = 1       # latent frames padded at the front to a multiple of this (CogVideoX 1.5: 2); 1: none
    patch: int = 1     # the transformer's temporal patch: it divides the (padded) latent frames
    chunk: int = 0     # video frames the VAE encodes per chunk (AutoencoderKLMiniMaxH3's clip_length 17); 0: none
    chunk_latents: int = 0  # latent frames per chunk (its tokens_chunk_size 5)
    chunk_drop: int = 0     # latent frames dropped after the last chunk (its token_drop 3)

    def latent_frames(self, frames: int) -> int | None:
        """The latent frames stored for ``frames`` video frames (padded where the VAE pads); None: not a count this
        rule takes."""
        if self.chunk:  # chunk x n + chunk_latents frames, the last chunk padded with copies of the last frame
            if frames < 1 or frames % self.chunk != self.chunk_latents:
                return None
            latent = (frames // self.chunk + 1) * self.chunk_latents - self.chunk_drop
            return latent if latent % self.patch == 0 else None
        if frames < 1 or (frames - 1) % self.temporal:
            return None
        latent = (frames - 1) // self.temporal + 1
        if self.pad > 1:
            if latent % self.pad != 1 % self.pad:  # the pad makes it a multiple of pad: one copy per missing frame
                return None
            latent += self.pad - 1
        return latent if latent % self.patch == 0 else None

    def nearest(self, frames: int) -> list[int]:
        """The valid counts nearest ``frames``: the largest below and the smallest above (one where there is none
        below)."""
        below = next((f for f in range(frames - 1, 0, -1) if self.latent_frames(f) is not None), None)
        above = next((f for f in range(frames + 1, frames + SEARCH) if self.latent_frames(f) is not None), None)
        return [f for f in (below, above) if f is not None]

    def describe(self) -> str:
        """The rule in words: "1 + k x 4 (...)"."""
        if self.chunk:
            rule = (f"{self.chunk} x n + {self.chunk_latents} (the VAE encodes {self.chunk}-frame chunks into "
                    f"{self.chunk_latents} latent frames each and drops {self.chunk_drop}: "
                    f"{self.chunk_latents} x n + {self.chunk_latents - self.chunk_drop} latent frames)")
            return rule + (f" with a latent count that is a multiple of the model's temporal patch {self.patch}"
                           if self.patch > 1 else "")
        step = self.temporal * self.pad
        if self.temporal == 1:
            return f"a multiple of the model's temporal patch {self.patch}"
        rule = f"1 + k x {step}"
        if self.pad > 1:
            rule += (f" (the VAE's temporal compression {self.temporal}, its latents padded to a multiple of "
                     f"{self.pad} frames that decoding drops)")
        else:
            rule += f" (the VAE's temporal compression {self.temporal})"
        if self.patch > 1 and self.patch % self.pad:
            rule += f" with 1 + k a multiple of the model's temporal patch {self.patch}"
        return rule

    def check(self, setting: str, frames, *, who: str = "the model") -> int:
        """``frames``' latent frames, or a ConfigError naming ``setting``, the value, the rule and the nearest valid
        counts (``who``: what takes them, e.g. "wan's VAE")."""
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            raise ConfigError(f"{setting} must be a positive whole number of frames, got {frames!r}")
        latent = self.latent_frames(frames)
        if latent is not None:
            return latent
        valid = self.nearest(frames)
        nearest = f"the nearest valid counts are {valid[0]} and {valid[1]}" if len(valid) == 2 else \
            f"the nearest valid count is {valid[0]}"
        raise ConfigError(f"{setting}={frames} is not a frame count {who} takes: {self.describe()}; {nearest}")
