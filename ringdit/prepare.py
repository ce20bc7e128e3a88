"""Encode captioned images or videos into ``data=text_latents`` shards for training.

    python -m ringdit.prepare input=clips/ out=data/clips vae=Wan2.1-T2V text_encoder=Wan2.1-T2V \
        resolution=[480,832] frames=81 max_text_len=512
    torchrun --nproc-per-node 8 -m ringdit.prepare ...        # rank r encodes shards r, r + 8, ...; re-run resumes

Settings (defaults in ``DEFAULTS``): input (a folder: images or videos, captions as sidecar .txt or a
metadata.jsonl / metadata.csv with file_name + ``caption_column``), out, vae (a diffusers folder; ``vae_subfolder``
inside it when present), text_encoder / tokenizer (transformers folders; the tokenizer defaults to the encoder's
pipeline), resolution (int, [H, W] or "HxW"), frames + frame_stride (videos), max_text_len, shard_size, batch_size,
device, dtype (stored tensors), tiling / tile (VAE spatial tiles: on / their size in pixels). The work itself is
``ringdit.media.prepare``.
"""

from __future__ import annotations

import logging
import sys

from ringdit.config import user_errors
from ringdit.media.cli import parse_settings

DEFAULTS = dict(input=None, out=None, vae=None, text_encoder=None, tokenizer=None, vae_subfolder="vae",
                caption_column="text", resolution=256, frames=17, frame_stride=1, max_text_len=512, shard_size=64,
                batch_size=4, device=None, dtype="float32", tiling=True, tile=None)
USAGE = "python -m ringdit.prepare input=FOLDER out=FOLDER vae=FOLDER text_encoder=FOLDER [tokenizer=.. resolution=..]"


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with user_errors():  # a wrong setting or input: one line, exit code 2
        settings = parse_settings(sys.argv[1:] if argv is None else argv, DEFAULTS,
                                  ("input", "out", "vae", "text_encoder"), USAGE)
        from ringdit.media.prepare import prepare

        report = prepare(**settings)
    print(report.summary(), flush=True)


if __name__ == "__main__":
    main()
