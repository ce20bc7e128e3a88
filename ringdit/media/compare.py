"""How far apart two prepared folders are, tensor by tensor: what ``dtype=bfloat16`` encoders change against float32.

    python -m ringdit.media.compare data/clips-fp32 data/clips-bf16
    latents      max |a - b| 0.0123  mean |a - b| 0.00211  (max |a| 2.93, 1024 values)
    text         ...

Both folders hold the same shards (prepared from the same input with the same buckets); each key's values are compared
in float64 over every shard (a key one side lacks is named). Exit code 2 and one line for folders that do not match.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ringdit.common.errors import ConfigError
from ringdit.data.text_latent_shards import Shard


def compare_folders(a: str | Path, b: str | Path, keys: tuple[str, ...] | None = None) -> dict[str, dict[str, float]]:
    """{key: {"max": max |a - b|, "mean": mean |a - b|, "scale": max |a|, "count": values}} over every shard (its
    text file's keys too)."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    shards = sorted(p.name for p in a.glob("shard-*.safetensors"))
    if not shards:
        raise ConfigError(f"{a} holds no shard-*.safetensors; pass two folders python -m ringdit.prepare wrote")
    missing = [name for name in shards if not (b / name).is_file()]
    if missing:
        raise ConfigError(f"{b} has no {missing[0]} (which {a} has); compare folders prepared from the same input "
                          f"with the same settings but the one compared")
    totals: dict[str, list[float]] = {}
    for name in shards:
        sa, sb = Shard(a / name), Shard(b / name)
        common = tuple(key for key in sorted(set(sa.shapes) & set(sb.shapes)) if keys is None or key in keys)
        values_a, values_b = sa.read(common, 0, sa.size), sb.read(common, 0, sb.size)
        for key in common:
            x, y = values_a[key], values_b[key]
            if not x.is_floating_point():
                continue
            if x.shape != y.shape:
                raise ConfigError(f"{name}: {key} is {tuple(x.shape)} in {a} but {tuple(y.shape)} in {b}; compare "
                                  f"folders prepared with the same sizes")
            diff = (x.double() - y.double()).abs()
            total = totals.setdefault(key, [0.0, 0.0, 0.0, 0])
            total[0] = max(total[0], float(diff.max()) if diff.numel() else 0.0)
            total[1] += float(diff.sum())
            total[2] = max(total[2], float(x.double().abs().max()) if x.numel() else 0.0)
            total[3] += diff.numel()
    return {key: {"max": t[0], "mean": t[1] / max(t[3], 1), "scale": t[2], "count": t[3]} for key, t in totals.items()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m ringdit.media.compare FOLDER_A FOLDER_B  (two prepared folders)", file=sys.stderr)
        return 2
    try:
        result = compare_folders(*argv)
    except ConfigError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 2
    for key, stats in result.items():
        print(f"{key:<16} max |a - b| {stats['max']:.4g}  mean |a - b| {stats['mean']:.4g}  (max |a| "
              f"{stats['scale']:.4g}, {stats['count']} values)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
