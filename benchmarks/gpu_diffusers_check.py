"""One-GPU check of this round's GPU paths (run by benchmarks/gpu_check.sh on a CUDA machine):

A. diffusers' Wan transformer (Wan 1.3B's width and heads, few layers) with ringdit's attention (torch_flash, bf16)
   against the unmodified model with diffusers' own attention, both against an fp32 reference: errors and step time.
B. cuDNN attention that returns the LSE (``_scaled_dot_product_cudnn_attention``): its LSE layout, whether its
   backward, fed the FINAL merged out/LSE of two K/V chunks, gives chunk gradients that add up (what ring attention
   needs), and its speed against the flash kernel.
C. FSDP2 (``fully_shard`` per block, bf16 params / fp32 reduce) of the same Wan model on CUDA through ringdit's
   attention: step time, peak memory and gradient agreement with the unsharded model.

    python benchmarks/gpu_diffusers_check.py [--layers 4] [--frames 21 --height 60 --width 104]
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import torch
import torch.nn.functional as F

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                eps=1e-6, rope_max_seq_len=1024)


def timed(fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def wan_models(layers, dtype):
    import diffusers

    from ringdit.models.build import build_model

    config = {**WAN_1_3B, "num_layers": layers}
    torch.manual_seed(0)
    reference = diffusers.WanTransformer3DModel.from_config(config).cuda()
    ours, _ = build_model({"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan",
                           "config": config, "text_len": 512, "text_dim": 4096}, backend="torch_flash")
    ours.transformer.load_state_dict(reference.state_dict())
    return reference.to(dtype), ours.cuda().to(dtype)


def check_wan(args):
    shape = (args.frames, args.height, args.width)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, 16, *shape, device="cuda", generator=g)
    t = torch.tensor([600.0], device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", generator=g)
    dout = torch.randn(1, 16, *shape, device="cuda", generator=g)
    tokens = shape[0] * shape[1] // 2 * shape[2] // 2
    results = {}
    ref32, _ = wan_models(args.layers, torch.float32)
    out32 = ref32(x, t, text, return_dict=False)[0]
    (out32 * dout).sum().backward()
    grad32 = {k: p.grad.float() for k, p in ref32.named_parameters()}
    del ref32
    reference, ours = wan_models(args.layers, torch.bfloat16)
    for name, call, model in (
        ("diffusers (its SDPA)", lambda: reference(x.bfloat16(), t, text.bfloat16(), return_dict=False)[0], reference),
        ("ringdit torch_flash", lambda: ours(x.bfloat16(), t, {"text": text.bfloat16()}), ours.transformer),
    ):
        model.zero_grad()
        out = call()
        (out.float() * dout).sum().backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        grad_err = max(rel(grads[k], grad32[k]) for k in grad32)

        def step():
            (call().float() * dout).sum().backward()

        torch.cuda.reset_peak_memory_stats()
        seconds = timed(step, 3)
        with torch.no_grad():
            fwd = timed(call, 3)
        results[name] = (rel(out, out32), grad_err, seconds, fwd, torch.cuda.max_memory_allocated() / 2**30)
    print(f"\nA. Wan-shaped ({args.layers} layers, 12 heads x 128, {tokens} video tokens + 512 text), bf16, one H200")
    print("| attention | out rel. err vs fp32 | worst param-grad rel. err | fwd+bwd (ms) | forward (ms) | peak GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (out_err, grad_err, seconds, fwd, peak) in results.items():
        print(f"| {name} | {out_err:.2e} | {grad_err:.2e} | {seconds * 1e3:.0f} | {fwd * 1e3:.0f} | {peak:.1f} |")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_cudnn(args):
    aten = torch.ops.aten
    B, H, D = 1, 12, 128
    for S in (4096,):
        g = torch.Generator(device="cuda").manual_seed(2)
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
        scale = D**-0.5
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
        out, lse = res[0], res[1]
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        lse_ref = torch.logsumexp(scores, -1)  # (B, H, S)
        print(f"\nB. cuDNN attention with LSE, S={S}, H={H}, D={D}, bf16: out {tuple(out.shape)} "
              f"stride {out.stride()}, lse {tuple(lse.shape)} {lse.dtype} stride {lse.stride()}")
        print(f"   lse max abs err vs fp32: {(lse.float().reshape(lse_ref.shape) - lse_ref).abs().max().item():.2e}; "
              f"out rel err vs fp32: {rel(out, torch.softmax(scores, -1) @ v.float()):.2e}")
        # two K/V chunks, merged by LSE; each chunk's backward fed the FINAL out / lse
        half = S // 2
        parts = [aten._scaled_dot_product_cudnn_attention(q, k[:, :, s], v[:, :, s], None, True, 0.0, False, False,
                                                          scale=scale) for s in (slice(0, half), slice(half, S))]
        lses = torch.stack([p[1].float().reshape(B, H, S) for p in parts])
        merged_lse = torch.logsumexp(lses, 0)
        weights = torch.exp(lses - merged_lse)[..., None]
        merged = sum(w * p[0].float() for w, p in zip(weights, parts)).to(torch.bfloat16)
        print(f"   merged 2-chunk out rel err vs one call: {rel(merged, out):.2e}")
        qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
        ref = torch.softmax((qf @ kf.transpose(-1, -2)) * scale, -1) @ vf
        ref.backward(dout.float())
        for bias_name, bias in (("None", None), ("empty tensor", torch.empty(0, device="cuda", dtype=q.dtype))):
            try:
                dq = torch.zeros_like(q, dtype=torch.float32)
                dks, dvs = [], []
                for s, p in zip((slice(0, half), slice(half, S)), parts):
                    lse_final = merged_lse.reshape(p[1].shape).to(p[1].dtype).as_strided(p[1].shape, p[1].stride())
                    grads = aten._scaled_dot_product_cudnn_attention_backward(
                        dout, q, k[:, :, s], v[:, :, s], merged, lse_final, p[6], p[7], bias, p[2], p[3], p[4],
                        p[5], 0.0, False, scale=scale)
                    dq += grads[0].float()
                    dks.append(grads[1])
                    dvs.append(grads[2])
                print(f"   chunked backward (attn_bias={bias_name}) with the final out/lse: dq rel err "
                      f"{rel(dq, qf.grad):.2e}, dk {rel(torch.cat(dks, 2), kf.grad):.2e}, dv "
                      f"{rel(torch.cat(dvs, 2), vf.grad):.2e} (one-call bf16 flash: dq "
                      f"{_flash_dq_err(q, k, v, dout, scale, qf.grad):.2e})")
                break
            except Exception as error:  # the op's signature differs between torch versions
                print(f"   chunked backward (attn_bias={bias_name}) failed: {type(error).__name__}: "
                      f"{str(error).splitlines()[0][:300]}")
    S = 16384
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for name, op in (("cudnn", lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                                                scale=scale)),
                     ("flash", lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False,
                                                                                scale=scale))):
        seconds = timed(op, 10)
        print(f"   forward with LSE, S={S}: {name} {seconds * 1e3:.2f} ms, "
              f"{4 * B * H * S * S * D / seconds / 1e12:.0f} TFLOP/s")


def _flash_dq_err(q, k, v, dout, scale, dq_ref):
    qq = q.clone().requires_grad_()
    out = F.scaled_dot_product_attention(qq, k, v, scale=scale)
    out.backward(dout)
    return rel(qq.grad, dq_ref)


def check_fsdp(args):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    shape = (args.frames, args.height, args.width)
    x = torch.randn(1, 16, *shape, device="cuda")
    t = torch.tensor([600.0], device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda")
    rows = {}
    for name in ("replicated (bf16 autocast)", "FSDP2 (bf16 params, fp32 reduce)"):
        _, ours = wan_models(args.layers, torch.float32)
        if name.startswith("FSDP2"):
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in ours.transformer.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(ours, mp_policy=policy)
            context = _null()
        else:
            context = torch.autocast("cuda", dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-5)

        def step():
            with context:
                loss = ours(x, t, {"text": text}).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        torch.cuda.reset_peak_memory_stats()
        seconds = timed(step, 3)
        rows[name] = (seconds, torch.cuda.max_memory_allocated() / 2**30, step().item())
        del ours, optimizer
        torch.cuda.empty_cache()
    print(f"\nC. FSDP2 on CUDA (world 1), Wan-shaped {args.layers} layers, fwd+bwd+AdamW")
    print("| model | step (ms) | peak GiB | loss after 5 steps |")
    print("|---|---:|---:|---:|")
    for name, (seconds, peak, loss) in rows.items():
        print(f"| {name} | {seconds * 1e3:.0f} | {peak:.1f} | {loss:.5f} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--height", type=int, default=60)
    parser.add_argument("--width", type=int, default=104)
    parser.add_argument("--only", nargs="*", default=["wan", "cudnn", "fsdp"])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    torch.backends.cudnn.allow_tf32 = False  # a true fp32 reference (the patch embedding is a Conv3d)
    for name, check in (("wan", check_wan), ("cudnn", check_cudnn), ("fsdp", check_fsdp)):
        if name in args.only:
            try:
                check(args)
            except Exception:
                print(f"\n{name} check failed:\n{traceback.format_exc()[-3000:]}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
