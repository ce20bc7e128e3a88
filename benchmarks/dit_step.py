"""Training-step time of one DiT on one device (forward + backward + AdamW), eager or compiled.

    python benchmarks/dit_step.py --model dit_xl --input-size 32 --batch 8 --device cuda --dtype bfloat16
    python benchmarks/dit_step.py --model dit_digits --input-size 16 --batch 32 --compile

--model is a DiT preset of conf/model (dit_xl, dit_l, dit_b, dit_s, dit_digits, dit_video), --patch-size its patch.
"""

from __future__ import annotations

import argparse
import time

import torch

from ringdit.models.build import build_model
from ringdit.commands.cli import CONF_DIR, model_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    presets = sorted(p.stem for p in (CONF_DIR / "model").glob("dit_*.yaml"))
    parser.add_argument("--model", default="dit_s", choices=presets)
    parser.add_argument("--patch-size", type=int, default=2)
    parser.add_argument("--input-size", type=int, nargs="+", default=[32], help="H W, or T H W with --temporal-patch")
    parser.add_argument("--in-channels", type=int, default=4)
    parser.add_argument("--temporal-patch", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="autocast dtype on CUDA (bfloat16), float32 = off")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (regional)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    size = args.input_size[0] if len(args.input_size) == 1 else tuple(args.input_size)
    video = {} if args.temporal_patch is None else {"temporal_patch_size": args.temporal_patch}  # else the preset's
    config = {**model_preset(args.model), "patch_size": args.patch_size, "input_size": size,
              "in_channels": args.in_channels, "num_classes": 1000, **video}
    model, _ = build_model(config, backend=args.backend, compile=args.compile)  # as training builds it
    model.to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    spatial = (size, size) if isinstance(size, int) else size
    x = torch.randn(args.batch, args.in_channels, *spatial, device=args.device)
    t = torch.rand(args.batch, device=args.device) * 1000
    y = torch.randint(0, 1000, (args.batch,), device=args.device)
    autocast = torch.autocast(args.device.split(":")[0], dtype=getattr(torch, args.dtype),
                              enabled=args.dtype != "float32")

    def step():
        with autocast:
            loss = model(x, t, y).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    for _ in range(2):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.batch * model.x_embedder(x[:1]).shape[1]
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"| {args.model} | {tuple(x.shape)} | {tokens // args.batch} tok/sample | {args.device} {args.dtype} | "
          f"backend {model.blocks[0].attn.inner_attention.attention.backend.name} | compile {args.compile} | first step {first:.2f} s | "
          f"{seconds * 1e3:.1f} ms/step | {tokens / seconds:,.0f} tok/s | {6 * params * tokens / seconds / 1e12:.2f} "
          f"TFLOP/s (6 N D) |")
    if args.device.startswith("cuda"):
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
