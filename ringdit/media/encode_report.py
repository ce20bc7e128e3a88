"""What ``encode_folder`` did: the shards and samples written, the files left out and why, its one-line summary."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EncodeReport:
    shards_written: int = 0
    shards_skipped: int = 0  # already present (resume)
    texts_encoded: int = 0  # already present, their text re-encoded: new captions or text encoder (media/retext.py)
    samples: int = 0
    unreadable: list[str] = field(default_factory=list)
    too_short: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # listed in metadata.jsonl / .csv but not there (rank 0 counts)
    stills: list[str] = field(default_factory=list)  # task=i2v: images (and 1-frame clips), no video to condition
    seconds: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)  # bucket name (HxWxT) -> samples written now
    tile_batches: int | None = None  # parallel_vae=true, ranks > 0: the VAE batches whose tiles this rank shared

    def summary(self) -> str:
        if self.tile_batches is not None:  # a helper rank wrote nothing: say so instead of "0 samples"
            return (f"parallel_vae=true: encoded a share of the VAE tiles of {self.tile_batches} batches in "
                    f"{self.seconds:.1f} s; rank 0 wrote the shards and reports them")
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        return (f"prepared {self.samples} samples into {self.shards_written} new shards "
                f"({self.shards_skipped} already done{self._retexted()}) in {self.seconds:.1f} s "
                f"({rate:.2f} samples/s); skipped "
                f"{len(self.unreadable)} unreadable files{_named(self.unreadable)}, {len(self.too_short)} clips too "
                f"short for the bucket{_named(self.too_short)} and {len(self.missing)} files the metadata lists that "
                f"are missing or not images / videos{_named(self.missing)}" + (
                    f"; task=i2v: left out {len(self.stills)} images or 1-frame clips, which have no video to "
                    f"condition on their first frame{_named(self.stills)}" if self.stills else "") + (
                    "; by bucket: " + ", ".join(f"{name}: {count} samples" for name, count in self.buckets.items())
                    if self.buckets else ""))


    def _retexted(self) -> str:
        return f", {self.texts_encoded} re-encoded for new captions or a new text encoder, their latents kept" \
            if self.texts_encoded else ""


def _named(paths: list[str], shown: int = 5) -> str:
    """`` (a, b, ... and 3 more)`` for a summary line; empty for none."""
    if not paths:
        return ""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return f" ({', '.join(paths[:shown])}{more})"
