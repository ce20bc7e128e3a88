"""The ranks of a prepare: this process's rank and device (torchrun's environment), and, with parallel_vae=true,
the ``TileGroup`` through which rank 0 shares each VAE batch's tiles with the others."""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist

from ringdit.common.errors import ConfigError
from ringdit.media.encode_report import EncodeReport
from ringdit.media.parallel_vae import IMAGE, VIDEO
from ringdit.media.vae import VAE


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def default_device() -> str:
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


class TileGroup:
    """parallel_vae=true on several ranks: rank 0 (the leader) prepares as one process and, for each VAE batch,
    sends its pixels to the other ranks (the helpers), which then encode their share of its tiles with it.

    One message a batch -- (shape, dtype) by ``broadcast_object_list``, then the pixels by ``broadcast`` -- and
    ``None`` when the leader is done. The helpers need nothing but the VAE and this stream, so they read no file and
    load no text encoder, and whatever ends the leader's run (its last shard, a settings error, a SIGTERM) ends
    theirs: ``joined`` sends the ``None`` on the way out, unless the leader stopped inside a batch's collectives,
    where a stray message would not match what the helpers wait for; torchrun then stops them."""

    # The helpers wait on the leader's setup (probing every file, loading the text encoder) and on its file reading,
    # text encoding and writing between batches: far longer than a collective usually takes.
    TIMEOUT = datetime.timedelta(hours=2)

    def __init__(self, group, transport: torch.device):
        self.group, self.transport = group, transport
        self.leading = False  # rank 0 passed the checks every rank makes: the helpers are serving and wait for it
        self.busy = False  # inside a batch's collectives

    @classmethod
    @contextlib.contextmanager
    def joined(cls, wanted: bool, rank: int, world_size: int, device: str | None):
        """The TileGroup of this rank (None unless ``wanted``); the process group made from torchrun's environment
        (``MASTER_ADDR`` ...) unless one is initialised, and destroyed after if made here."""
        if not wanted:
            yield None
            return
        made = not dist.is_initialized()
        on = torch.device(device or default_device())
        if not made and dist.get_world_size() != world_size:
            raise ConfigError(f"parallel_vae=true: the process group has {dist.get_world_size()} ranks but "
                              f"world_size={world_size} (WORLD_SIZE); launch with torchrun, which sets both alike")
        if made:
            if on.type == "cuda":
                torch.cuda.set_device(on)
            dist.init_process_group("nccl" if on.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                    timeout=cls.TIMEOUT)
        group = dist.group.WORLD
        tiles = cls(group, on if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        try:
            yield tiles
        finally:
            if tiles.leading and not tiles.busy:
                tiles._announce(None)  # the helpers stop, however the leader ended
            if made:
                dist.destroy_process_group()

    @staticmethod
    def check(codec: VAE, setting) -> None:
        """A clear error, on every rank alike, where ``codec`` cannot split its encode into tiles."""
        name = type(codec.model).__name__
        if name not in VIDEO + IMAGE:
            raise ConfigError(f"parallel_vae=true: vae={setting} is {name}, whose encode ringdit cannot split into "
                              f"tiles (it can for {', '.join(VIDEO + IMAGE)}); pass parallel_vae=false")
        if not getattr(codec.model, "use_tiling", False):
            raise ConfigError(f"parallel_vae=true: vae={setting} ({name}) has spatial tiling off, so there are no "
                              f"tiles to split; pass tiling=true, or parallel_vae=false")

    def _announce(self, pixels: torch.Tensor | None) -> None:
        dist.broadcast_object_list([None if pixels is None else (tuple(pixels.shape), pixels.dtype)], src=0,
                                   group=self.group)

    def leader(self, codec: VAE):
        """Rank 0's ``encode``: the batch to every rank, then its tiles encoded by all of them; latents here."""
        self.leading = True

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            self.busy = True
            self._announce(pixels)
            dist.broadcast(pixels.to(self.transport).contiguous(), src=0, group=self.group)
            latents = codec.encode(pixels, group=self.group, dst=0)
            self.busy = False
            return latents
        return encode

    def serve(self, codec: VAE) -> EncodeReport:
        """A helper's whole run: each batch rank 0 announces, received and encoded with it, until its ``None``."""
        report, start = EncodeReport(tile_batches=0), time.perf_counter()
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=self.group)
            if message[0] is None:
                break
            shape, dtype = message[0]
            pixels = torch.empty(shape, dtype=dtype, device=self.transport)
            dist.broadcast(pixels, src=0, group=self.group)
            codec.encode(pixels, group=self.group, dst=0)  # None here: the latents go to rank 0
            report.tile_batches += 1
        report.seconds = time.perf_counter() - start
        return report
