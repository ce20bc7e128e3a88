"""Joint text-image attention with a replicated text prefix (Flux, QwenImage).

Those models concatenate a few text tokens and many image tokens and run ONE attention over ``[text ; image]``.
Under sequence parallelism only the image is sharded; every SP rank holds ALL text tokens (identical values): the
"replicated prefix". ``USPAttention.forward(q, k, v, joint_prefix=P, prefix_mask=...)`` takes
``[B, P + S_local, H, D]`` = ``[text ; this rank's image shard]`` and returns the same layout.

Why the text K/V are counted exactly once per query:
- Ring: the text K/V are NOT part of the rotating image blocks. Each rank attends its queries to them once, as a
  local extra chunk merged by LSE into the ring result; rotating or re-sending them would add them once per hop.
  Text queries attend the text chunk and every image block as it passes, so their output is complete on every
  rank. They are merged in a fixed order (text chunk, then image blocks 0..R-1), so every rank of a ring computes
  the same bits for them: the replicated text stays exactly replicated.
- Ulysses: image q/k/v go through the all-to-all (sequence shard -> head shard). The text is already whole on
  every rank, so each rank takes its own head slice, attends it, and the text output heads are all-gathered.

Gradients follow ``ringdit.parallel.collectives``: the objective is the SUM of the ranks' losses, and each rank's
replicated text q/k/v copy receives a partial gradient, such that summing the copies over the SP group gives the
one-device gradient. (Ulysses: a rank's text copy gets the gradient of its head slice, summed over the Ulysses
group by the gather's backward, a reduce-scatter. Ring: each rank adds the text-side gradient of its own queries
and of its own text-output rows; the image blocks' dK/dV travel home with the ring's accumulator.) A caller that
keeps replicated text parameters or activations must therefore sum (all-reduce) their gradients over the SP group,
as DDP does for parameters.

Masking (``prefix_mask``, True = real text token; QwenImage pads text to a fixed length): masked text KEYS get
no attention weight; masked text query rows still attend normally, as in diffusers. Kernels take no masks: each
sample's text K/V are cut to its real tokens (any boolean pattern) in a short per-sample loop over the text chunk.
A sample with no real text token attends to the image only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringdit.attention.backend import AttentionBackend, Tensor, accumulation_dtype
from ringdit.parallel.mesh import ProcessGroup


def check_joint_args(q: Tensor, k: Tensor, v: Tensor, joint_prefix: int, prefix_mask: Tensor | None) -> None:
    """Raise a clear error for a prefix that does not fit the inputs."""
    if isinstance(joint_prefix, bool) or not isinstance(joint_prefix, int) or not 0 <= joint_prefix <= q.shape[1]:
        raise ValueError(
            f"joint_prefix must be an integer in [0, {q.shape[1]}] (the number of replicated text tokens at the "
            f"start of dim 1 of q, k, v), got {joint_prefix!r}"
        )
    if joint_prefix and (k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]):  # plain calls may differ (local)
        raise ValueError(
            f"joint attention needs q, k, v of the same length along dim 1, got {q.shape[1]}, {k.shape[1]}, "
            f"{v.shape[1]}"
        )
    if prefix_mask is None:
        return
    if joint_prefix == 0:
        raise ValueError("prefix_mask was given with joint_prefix=0; pass joint_prefix = the number of text tokens")
    if prefix_mask.dtype != torch.bool or tuple(prefix_mask.shape) != (q.shape[0], joint_prefix):
        raise ValueError(
            f"prefix_mask must be a bool tensor of shape (batch, joint_prefix) = ({q.shape[0]}, {joint_prefix}) "
            f"with True for real text tokens, got {prefix_mask.dtype} of shape {tuple(prefix_mask.shape)}"
        )


def real_prefix_indices(prefix_mask: Tensor | None) -> list[Tensor] | None:
    """Per sample, the positions of its real text tokens; None when every text token is real (no per-sample work).

    Reading the mask synchronises with the device once per call (``all``, ``nonzero``): text masks are tiny.
    """
    if prefix_mask is None or bool(prefix_mask.all()):
        return None
    return [row.nonzero().squeeze(1) for row in prefix_mask]


# ---- the text K/V chunk (ring-capable backends) -----------------------------------------------------------------
def prefix_chunk_forward(
    backend: AttentionBackend, softmax_scale, q: Tensor, k_text: Tensor, v_text: Tensor, text_keys
) -> tuple[Tensor, Tensor]:
    """Attend ``q (B, Sq, h, D)`` to the text K/V ``(B, P, h, D)`` without their masked keys.

    Returns ``(out (B, Sq, h, D), lse (B, h, Sq))`` like ``forward_ring_kv_chunk``. A sample with no real text key
    gets ``out = 0, lse = -inf``: it adds nothing to an LSE merge.
    """
    if text_keys is None:
        return backend.forward_ring_kv_chunk(q, k_text, v_text, softmax_scale=softmax_scale)
    batch, length, heads, _ = q.shape
    out = torch.zeros_like(q)
    lse = q.new_full((batch, heads, length), float("-inf"), dtype=accumulation_dtype(q.dtype))
    for b, keys in enumerate(text_keys):
        if len(keys):
            sample = slice(b, b + 1)
            out[sample], lse[sample] = backend.forward_ring_kv_chunk(
                q[sample], k_text[sample, keys], v_text[sample, keys], softmax_scale=softmax_scale
            )
    return out, lse


def prefix_chunk_backward(
    backend: AttentionBackend, softmax_scale, dout, q, k_text, v_text, out, lse, text_keys
) -> tuple[Tensor, Tensor, Tensor]:
    """The text chunk's ``(dq, dk_text, dv_text)`` given the FINAL ``out``/``lse``; masked keys get zero gradient."""
    if text_keys is None:
        return backend.backward_ring_kv_chunk(dout, q, k_text, v_text, out, lse, softmax_scale=softmax_scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k_text), torch.zeros_like(v_text)
    for b, keys in enumerate(text_keys):
        if len(keys):
            sample = slice(b, b + 1)
            dq[sample], dk[sample, keys], dv[sample, keys] = backend.backward_ring_kv_chunk(
                dout[sample], q[sample], k_text[sample, keys], v_text[sample, keys], out[sample], lse[sample],
                softmax_scale=softmax_scale,
            )
    return dq, dk, dv


# ---- local joint attention (no ring; any backend, through its differentiable ``forward``) -----------------------
def local_joint_attention(
    backend: AttentionBackend,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    joint_prefix: int,
    prefix_mask: Tensor | None = None,
    softmax_scale: float | None = None,
    valid_len: int | None = None,
) -> Tensor:
    """Attention over ``[text ; image]`` held whole here: ``q, k, v (B, P + S, H, D) -> (B, P + S, H, D)``.

    ``valid_len`` counts the real image tokens (tail padding beyond them comes back as zero rows). Without masked
    text this is one kernel call over the real prefix of the joint sequence; with masked text, one call per sample
    whose keys are that sample's real text tokens and the real image tokens (the same FLOPs, B calls instead of
    one). Works for every backend, also those without the ring hooks (``torch_sdpa``).
    """
    length = q.shape[1]
    real_len = length if valid_len is None else min(length, joint_prefix + max(valid_len, 0))
    text_keys = real_prefix_indices(prefix_mask)
    if text_keys is None:
        out = backend.forward(q[:, :real_len], k[:, :real_len], v[:, :real_len], softmax_scale=softmax_scale)
    else:
        image_keys = torch.arange(joint_prefix, real_len, device=q.device)
        rows = []
        for b, keys in enumerate(text_keys):
            keys = torch.cat([keys, image_keys])  # this sample's real text tokens, then the real image tokens
            sample = slice(b, b + 1)
            if len(keys):
                q_rows, k_keys, v_keys = q[sample, :real_len], k[sample, keys], v[sample, keys]
                rows.append(backend.forward(q_rows, k_keys, v_keys, softmax_scale=softmax_scale))
            else:  # no real key at all: nothing to attend to
                rows.append(torch.zeros_like(q[sample, :real_len]))
        out = torch.cat(rows)
    if real_len < length:
        out = F.pad(out, (0, 0, 0, 0, 0, length - real_len))  # zero rows for the image tail padding
    return out


# ---- the text heads under Ulysses -------------------------------------------------------------------------------
def text_head_slice(x: Tensor, ulysses_rank: int, ulysses_degree: int) -> Tensor:
    """This Ulysses rank's heads of the replicated text ``(B, P, H, D) -> (B, P, H / U, D)``: the same split as the
    all-to-all gives the image heads. Its backward fills only this slice (the other ranks own the other heads)."""
    heads = x.shape[2] // ulysses_degree
    return x.narrow(2, ulysses_rank * heads, heads).contiguous()  # small; kernels get plain strides


class _GatherTextHeads(torch.autograd.Function):
    """All-gather head slices ``(B, P, H / U, D) -> (B, P, H, D)`` over the Ulysses group (rank order = head order).

    Backward: each rank's loss sent gradient to every head, so a rank's slice gets the SUM over the group of the
    gradients for its heads: a reduce-scatter, written as all-to-all + sum because gloo has no reduce_scatter.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        world = dist.get_world_size(ctx.group)
        send = torch.stack(grad.chunk(world, dim=2))  # (U, B, P, H / U, D), piece j goes to the owner of heads j
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=ctx.group)
        return recv.sum(dim=0), None


def gather_text_heads(x: Tensor, group: ProcessGroup | None) -> Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherTextHeads.apply(x, group)
