"""ringdit/media/buckets.py without any model or file: which bucket each file goes to (``python -m ringdit.prepare
buckets=auto`` or a list), the frame-count rule, the shard plan's grouping, and the settings' one-line errors. The
prepare runs with buckets (tiny VAEs) are in tests/test_media.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ringdit.common.errors import ConfigError
from ringdit.media.buckets import (Bucket, allowed_frames, auto_sizes, frame_count, make_buckets, nearest_size,
                                   parse_buckets, usable_frames)

WAN = dict(spatial=8, temporal=4, class_name="AutoencoderKLWan")  # what the Wan VAE's probe gives


def test_auto_sizes_follow_the_area_and_aspect_rule():
    """Multiples of the step, area at most the size's, 1:4 .. 4:1, the largest height for each width and its
    mirror image, the largest square; the size itself is a bucket when it is a multiple of the step."""
    area, step = 480 * 832, 16
    sizes = auto_sizes(area, step)
    assert (480, 832) in sizes and (832, 480) in sizes and (624, 624) in sizes
    for height, width in sizes:
        assert height % step == 0 and width % step == 0 and height * width <= area
        assert 1 / 4 <= width / height <= 4
        # the tallest that fits this width, or the mirror image of one
        assert (height, width) == (624, 624) or (height + step) * width > area or (width + step) * height > area
        assert (width, height) in sizes  # portrait and landscape alike
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert auto_sizes(32 * 32, 16) == [(16, 48), (16, 64), (32, 32), (48, 16), (64, 16)]
    assert make_buckets("auto", 32, frames=9, **WAN).sizes == ((16, 48), (16, 64), (32, 32), (48, 16), (64, 16))
    assert make_buckets("auto", [480, 832], frames=81, **WAN).sizes == tuple(sizes)  # size [H, W]: H * W


def test_nearest_aspect_ratio_within_the_area():
    """The bucket of nearest log aspect ratio; a listed bucket larger than the size's area is left out."""
    buckets = make_buckets([[256, 256], [256, 448], [448, 256], [512, 512]], 400, frames=81, **WAN)
    assert (512, 512) not in buckets.sizes  # 262144 px > 400 ** 2
    assert buckets.choose(1080, 1920, 40) == Bucket(256, 448, 37)  # 16:9 landscape
    assert buckets.choose(1920, 1080) == Bucket(448, 256, 1)  # a portrait image: one frame
    assert buckets.choose(1000, 1000) == Bucket(256, 256, 1)
    assert buckets.choose(100, 1000) == Bucket(256, 448, 1)  # 1:10 -> the widest there is
    assert buckets.choose(700, 1000).height == 256 and buckets.choose(700, 1000).width == 448  # log 0.56 vs log 0.7
    # equally near (the same ratio): the largest the file covers without upscaling, else the smallest
    sizes = [(128, 128), (256, 256), (64, 64)]
    assert nearest_size(200, 200, sizes) == (128, 128) and nearest_size(300, 300, sizes) == (256, 256)
    assert nearest_size(50, 50, sizes) == (64, 64)
    image_vae = make_buckets("auto", 32, spatial=2, temporal=None, frames=17)  # an image VAE: no T, step 4
    assert image_vae.choose(20, 60) == Bucket(16, 52) and Bucket(16, 52).name == "16x52"  # 3.25 nearest to 3
    assert Bucket(480, 832, 81).name == "480x832x81"


def test_frame_rule():
    """The longest allowed count (1 + k * temporal, at most frames; or frame_buckets) the clip has at the stride;
    too short for all: None (skipped); frame_buckets=[1, ...] keeps a short clip as one frame."""
    assert allowed_frames(81, 4) == list(range(5, 82, 4)) and allowed_frames(6, 4) == [5]
    assert usable_frames(40, 1) == 40 and usable_frames(40, 2) == 20 and usable_frames(41, 2) == 21
    assert usable_frames(0, 3) == 0
    assert frame_count(40, allowed_frames(81, 4)) == 37 and frame_count(4, allowed_frames(81, 4)) is None
    default = make_buckets("auto", 64, frames=81, frame_stride=2, **WAN)
    assert default.choose(64, 64, 200).frames == 81  # capped at frames
    assert default.choose(64, 64, 40).frames == 17  # 20 usable at stride 2
    assert default.choose(64, 64, 8) is None  # 4 usable: too short for 5
    listed = make_buckets("auto", 64, frames=81, frame_buckets=[33, 17, 81], **WAN)
    assert listed.frame_counts == (17, 33, 81)
    assert listed.choose(64, 64, 50).frames == 33 and listed.choose(64, 64, 10) is None
    assert make_buckets("auto", 64, frames=17, frame_buckets=[1, 17], **WAN).choose(64, 64, 10).frames == 1


def test_plan_groups_by_bucket_in_a_fixed_order():
    """Sorted files grouped by bucket (buckets by frames, height, width), each group cut into shards."""
    from ringdit.media.encode_folder import plan_shards
    from ringdit.media.folder import MediaItem

    a, b, c, d, e = (MediaItem(Path(f"{name}.png"), "x") for name in "abcde")
    wide, tall, clip = Bucket(16, 48, 1), Bucket(64, 16, 1), Bucket(32, 32, 5)
    plan = plan_shards([(a, clip), (b, tall), (c, wide), (d, tall), (e, tall)], shard_size=2)
    assert plan == [(wide, [c]), (tall, [b, d]), (tall, [e]), (clip, [a])]


@pytest.mark.parametrize("settings, message", [
    (dict(buckets="square"), r"buckets='square' is not null, auto or a list of \[H, W\]; pass buckets=null"),
    (dict(buckets=[480, 832]), r"buckets: the entry 480 is not an \[H, W\] pair"),
    (dict(buckets=[[20, 32]]), r"buckets: \[20, 32\] is not a multiple of AutoencoderKLWan's downsampling factor 8; "
                               r"use e.g. \[16, 32\]"),
    (dict(frame_buckets=[6]), r"frame_buckets: 6 is not a frame count AutoencoderKLWan encodes \(1 \+ k \* 4: 1, 5, "
                              r"9, ...\); use e.g. 5"),
    (dict(frame_buckets=[85]), r"frame_buckets: 85 is above frames=81, .* pass frames=85 or leave 85 out"),
    (dict(frame_buckets="17"), r"frame_buckets='17' is not null or a list of frame counts"),
    (dict(size=8), r"size=8 \(8x8\) is smaller than the smallest bucket buckets=auto can make, 16x16 "
                         r"\(bucket_step=16\); pass size>=16"),
    (dict(buckets=[[512, 512]], size=256), r"size=256 .* smaller than the smallest bucket in buckets, "
                                                 r"512x512; .* size=\[512,512\]"),
    (dict(bucket_step=12), r"bucket_step=12: .* multiple of the VAE's downsampling factor 8; e.g. bucket_step=16"),
    (dict(size="big"), r"size must be an int, \[H, W\] or 'HxW', got 'big'"),
])
def test_bad_bucket_settings_are_one_line(settings, message):
    settings = {"buckets": "auto", "size": 64, "frames": 81, **settings}
    with pytest.raises(ConfigError, match=message) as error:
        make_buckets(settings.pop("buckets"), settings.pop("size"), **settings, **WAN)
    assert "\n" not in str(error.value)


def test_parse_buckets_and_leaving_out_large_ones(caplog):
    assert parse_buckets(None) is None and parse_buckets("auto") == "auto" and parse_buckets(" AUTO ") == "auto"
    assert parse_buckets([[480, 832], "832x480", (480, 832)]) == [(480, 832), (832, 480)]
    with caplog.at_level(logging.WARNING):
        buckets = make_buckets([[16, 16], [64, 64]], 32, frames=5, **WAN)
    assert buckets.sizes == ((16, 16),) and "leaving out 64x64, larger in area than size=32" in caplog.text
