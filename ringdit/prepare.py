"""Encode captioned images or videos into ``data=text_latents`` shards for training.

    python -m ringdit.prepare input=clips/ out=data/clips vae=Wan2.1-T2V text_encoder=Wan2.1-T2V \
        size=[480,832] frames=81 max_text_len=512                 # one bucket: every clip cropped to 480x832x81
    python -m ringdit.prepare input=media/ out=data/media vae=Wan2.1-T2V text_encoder=Wan2.1-T2V \
        buckets=auto size=[480,832] frames=81                     # aspect-ratio / duration buckets, images too
    torchrun --nproc-per-node 8 -m ringdit.prepare ...        # rank r encodes shards r, r + 8, ...; re-run resumes
    torchrun --nproc-per-node 8 -m ringdit.prepare ... parallel_vae=true  # all 8 ranks on each clip: VAE tiles split
    python -m ringdit.prepare ... vae=Wan2.1-I2V text_encoder=Wan2.1-I2V task=i2v image_encoder=Wan2.1-I2V
                                         # + each clip's first-frame latents and CLIP embedding (image-to-video)
    python -m ringdit.prepare ... vae=FLUX.1-dev text_encoder=FLUX.1-dev/text_encoder_2 pooled_encoder=FLUX.1-dev \
        max_text_len=512                 # Flux: text from T5, pooled from CLIP, as FluxPipeline encodes prompts
    python -m ringdit.prepare ... vae=FLUX.2-dev text_encoder=FLUX.2-dev prompt_template=flux2 max_text_len=512
                                         # Flux.2: Mistral3 in Flux2Pipeline's chat format, its VAE's bn statistics
    python -m ringdit.prepare ... vae=HunyuanVideo-1.5 text_encoder=HunyuanVideo-1.5 prompt_template=hunyuan_video15 \
        max_text_len=1000 glyph_encoder=HunyuanVideo-1.5  # + its ByT5 over the captions' quoted text (glyph_text)
    python -m ringdit.prepare ... (HunyuanVideo-1.5-480p_i2v as above) task=i2v image_encoder=HunyuanVideo-1.5-480p_i2v
                                         # + each clip's first-frame latents and SigLIP embedding (its I2V)
    python -m ringdit.prepare ... frame_extraction=slide window_stride=16 source_fps=30
                                         # several windows a clip, each resampled by time from 30 fps to the model's
    python -m ringdit.prepare ... vae=Qwen-Image text_encoder=Qwen-Image prompt_template=qwenimage max_text_len=512
                                         # Qwen-Image: its Qwen2.5-VL as QwenImagePipeline.encode_prompt
    (the same command again after editing captions: only their text is re-encoded, the latents kept)

Settings: conf/prepare.yaml (``--help`` lists them with their defaults, ``--cfg job`` shows what a command line
composes to); the work itself is ``ringdit.media.encode_folder``.

SIGTERM (to a rank, or to torchrun, which passes it on; a rank that stops makes torchrun stop the others): each rank
stops at once -- after the shard it is writing, if any -- with exit code 143 and one line; every shard written is
complete (written whole, then renamed), and running the same command again resumes after them.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path


def _stopped_before_start(signum, frame) -> None:
    print(f"preempted: SIGTERM stopped preparing before it began; nothing to keep; exit code {128 + signum}",
          file=sys.stderr, flush=True)
    sys.exit(128 + signum)


if __name__ == "__main__":  # until the command's wrapper (ringdit.commands.task) takes over in main(): nothing started
    signal.signal(signal.SIGTERM, _stopped_before_start)

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from ringdit.commands.task import Task, command  # noqa: E402
from ringdit.common.errors import ConfigError  # noqa: E402

log = logging.getLogger("ringdit.prepare")


@command("prepare", doing="preparing")  # conf/prepare.yaml
def main(cfg: DictConfig, task: Task) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # a ??? left: one line
    # SIGTERM: this rank stops where it is, or right after the shard it is writing; exit code 143 (module docstring)
    task.stopping(*preempted(settings["out"]))
    # start-up time: torch and the encoders load after --help and the settings' checks
    from ringdit.media.encode_folder import encode_folder

    report = encode_folder(**settings)  # a wrong setting or input: one line, exit code 2
    if (report.tile_batches is None and not report.samples and not report.shards_skipped
            and not report.texts_encoded and world_of() == 1):
        # every file unreadable, too short or missing: not a success
        if report.too_short and not report.unreadable and not report.missing:  # the window is what is wrong
            resampled = f", source_fps={settings['source_fps']}" if settings.get("source_fps") else ""
            raise ConfigError(f"frames={settings['frames']}: the window is longer than every clip of input="
                              f"{settings['input']} ({len(report.too_short)} clips, e.g. "
                              f"{Path(report.too_short[0]).name}, at frame_stride={settings['frame_stride']}"
                              f"{resampled}); pass a smaller frames= (1 + k * the VAE's temporal factor, e.g. frames=1), or "
                              f"longer clips")
        raise ConfigError(f"input={settings['input']}: nothing was prepared -- {report.summary()}; fix or "
                          f"replace those files, or lower frames= / the buckets for short clips")
    task.start()
    print(report.summary(), flush=True)


def world_of() -> int:
    # start-up time: torch and the encoders load after --help and the settings' checks
    from ringdit.media.encode_folder import rank_and_world

    return rank_and_world()[1]


def preempted(out: str):
    """(what a SIGTERM stops, what it keeps) for the one line the run ends with."""
    # start-up time: torch and the encoders load after --help and the settings' checks
    from ringdit.media.encode_folder import rank_and_world

    rank, world = rank_and_world()
    folder = Path(str(out)).expanduser()

    def kept() -> str:  # asked when the line is written
        done = len(list(folder.glob("shard-*.safetensors")))
        return f"{done} complete shards in {folder} (of every rank); run the same command again to resume"

    return f"preparing (rank {rank} of {world})" if world > 1 else "preparing", kept


if __name__ == "__main__":
    main()
