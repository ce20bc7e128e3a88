"""compile=true: regional torch.compile of the DiT blocks gives eager's numbers, compiles once, and keeps ring /
Ulysses communication out of the graphs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers import TINY, logged_losses, run, tiny_dit


def test_regional_compile_matches_eager_and_compiles_once():
    torch._dynamo.reset()
    counters.clear()
    # fp64: Inductor's fused kernels round in another order than eager's (its reductions, its vector width, which
    # depends on the CPU): in fp32 ~2e-7 of max|out| and ~3e-7 of a gradient's max, measured on one machine; in fp64
    # ~5e-16. 1e-10 of max leaves 10^5 of headroom; a dropped or doubled op is off by O(1). (fp32 training under
    # compile is test_compile_with_ring_attention_equals_eager's.)
    eager = tiny_dit().double()
    compiled = copy.deepcopy(eager)
    for block in compiled.blocks:
        block.compile()
    graphs_after = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, t = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64), torch.rand(2, generator=g) * 1000
        y = torch.tensor([1, 4])
        outputs = []
        for model in (eager, compiled):
            model.zero_grad()
            out = model(x, t, y)
            out.square().mean().backward()
            outputs.append(out)
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-10 * outputs[0].abs().max().item())
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
            if a.requires_grad:  # every trainable parameter has a gradient on both sides (none lost it)
                assert a.grad is not None and b.grad is not None, f"{name} has no gradient"
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-10 * a.grad.abs().max().item(), msg=name)
        graphs_after.append(counters["stats"]["unique_graphs"])
    assert graphs_after[0] > 0, "nothing was compiled"
    assert graphs_after[-1] == graphs_after[0], f"recompiled after the first step: {graphs_after}"


def test_compile_with_ring_attention_equals_eager(tmp_path):
    """Ulysses' all-to-all sits in the same eager region as the ring's transfers (USPAttention._parallel_forward)."""
    common = [*TINY, "trainer.max_steps=3", "ring_degree=2"]
    run("train.py", tmp_path / "eager", *common)
    proc = run("train.py", tmp_path / "compiled", *common, "compile=true", env={"TORCH_LOGS": "recompiles"})
    eager, compiled = logged_losses(tmp_path / "eager"), logged_losses(tmp_path / "compiled")
    assert sorted(compiled) == [0, 1, 2]
    # fp32: compiled kernels may round in another order than eager's (~2e-7 of an output's max); the loss, a mean of
    # 16 x 256 squared errors, moves by ~1e-7 of itself, and AdamW (lr 1e-3) adds little: its normalised update can
    # change much only where a gradient is ~eps, where the loss barely depends on the weight. Measured: the same
    # logged losses; rel 1e-5 is ~100x the estimate.
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    # training compiles the block once per grad mode at most; a recompilation on every step would show up here
    assert proc.stderr.count("Recompiling function") <= 2, proc.stderr[-3000:]


def test_compile_on_buckets_recompiles_once_for_a_new_length():
    """Buckets: a token count that changes from step to step. The first new length recompiles each graph once with
    the sequence length symbolic (PyTorch's automatic dynamic shapes); later buckets, of any length, reuse those
    graphs. aot_eager: Dynamo's graphs and guards (what decides a recompilation) traced through AOT autograd, without
    Inductor's codegen (whose numbers the other tests here check): in fp64, 1e-10 of max as there, measured exact.
    Inductor on buckets: benchmarks/buckets.py."""
    from ringdit.models.build import build_model
    from tests.helpers import architecture

    torch._dynamo.reset()
    counters.clear()
    config = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan",
              "config": architecture("wan_tiny"), "input_size": [3, 6, 10], "in_channels": 4}
    torch.manual_seed(0)
    eager, _ = build_model(config, backend="math")
    eager = eager.double()
    compiled = copy.deepcopy(eager)
    from ringdit.models.build import compile_blocks

    compile_blocks(compiled, backend="aot_eager")  # Dynamo's graphs and guards, which decide recompiles; no codegen
    graphs = []
    shapes = [(3, 6, 10), (5, 6, 10), (3, 10, 6), (7, 6, 10)]  # 45, 75, 45, 105 tokens
    for step, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 4, *shape, generator=g, dtype=torch.float64)
        t = torch.rand(2, generator=g, dtype=torch.float64) * 1000
        cond = {"text": torch.randn(2, 8, 16, generator=g, dtype=torch.float64)}
        outputs = []
        for model in (eager, compiled):
            model.zero_grad()
            out = model(x, t, cond)
            out.square().mean().backward()
            outputs.append(out)
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-10 * outputs[0].abs().max().item())
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-10 * a.grad.abs().max().item(), msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "nothing was compiled"
    # a new length (75) recompiles (the static graphs become dynamic ones) ...
    assert graphs[1] > graphs[0]
    # ... and no later shape does: 2 more buckets, 1 more length, no new graph
    assert graphs[-1] == graphs[1], f"graphs after each step: {graphs}"
