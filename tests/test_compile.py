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
    eager = tiny_dit()
    compiled = copy.deepcopy(eager)
    for block in compiled.blocks:
        block.compile()
    graphs_after = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, t, y = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g) * 1000, torch.tensor([1, 4])
        outputs = []
        for model in (eager, compiled):
            model.zero_grad()
            out = model(x, t, y)
            out.square().mean().backward()
            outputs.append(out)
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
            if a.requires_grad:  # every trainable parameter has a gradient on both sides (none lost it)
                assert a.grad is not None and b.grad is not None, f"{name} has no gradient"
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
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
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    # training compiles the block once per grad mode at most; a recompilation on every step would show up here
    assert proc.stderr.count("Recompiling function") <= 2, proc.stderr[-3000:]
