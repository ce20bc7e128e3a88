"""Model sizes: the original DiT family and tiny presets that train in minutes on a laptop CPU."""

from __future__ import annotations

from functools import partial

from ringdit.models.dit import DiT

# name: (depth, hidden_size, num_heads) -- the original table (Peebles & Xie, 2023, Table 1)
SIZES = {
    "XL": (28, 1152, 16),
    "L": (24, 1024, 16),
    "B": (12, 768, 12),
    "S": (12, 384, 6),
    # ringdit's own: small enough to train on the built-in digits on a 2-core CPU
    "T": (6, 192, 6),
    "XT": (4, 96, 4),
}

PATCHES = (2, 4, 8)

DIT_MODELS = {
    f"DiT-{size}/{patch}": partial(DiT, depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch)
    for size, (depth, hidden, heads) in SIZES.items()
    for patch in PATCHES
}
