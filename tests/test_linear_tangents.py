"""``linear_tangents``: forward-mode AD through linear layers as one matmul for the tangent, with PyTorch's values."""

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from ringdit.common.linear_tangents import linear_tangents
from ringdit.models import DiT, parallelize


def dual_call(fn, primals, tangents, fast: bool):
    with torch.no_grad(), fwAD.dual_level():
        if fast:
            with linear_tangents():
                return fwAD.unpack_dual(fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents))))
        return fwAD.unpack_dual(fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents))))


def test_a_dit_jvp_in_its_input_and_time_equals_pytorchs_own_formula_in_fp64():
    torch.manual_seed(0)
    model = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=10,
                learn_sigma=False)
    for weight in (p for p in model.parameters() if p.dim() > 1):  # adaLN-zero would make the tangent zero
        torch.nn.init.normal_(weight, std=0.1)
    parallelize(model, backend="math")
    model = model.double()
    g = torch.Generator().manual_seed(1)
    x, dx = (torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    t, dt, y = torch.tensor([300.0, 700.0], dtype=torch.float64), torch.tensor([1.0, -2.0], dtype=torch.float64), \
        torch.tensor([1, 2])
    fn = lambda x, t: model(x, t, y)  # noqa: E731
    out, tangent = dual_call(fn, (x, t), (dx, dt), fast=True)
    expected_out, expected_tangent = dual_call(fn, (x, t), (dx, dt), fast=False)
    assert tangent.abs().max() > 1e-3
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(tangent, expected_tangent, rtol=1e-12, atol=1e-12)


def matmuls(fn) -> int:
    with torch.profiler.profile() as profile:
        fn()
    return sum(event.count for event in profile.key_averages() if event.key in ("aten::mm", "aten::addmm",
                                                                                 "aten::bmm", "aten::baddbmm"))


def test_the_tangent_costs_one_matmul_not_two():
    """PyTorch's formula multiplies the weight's zero tangent too (three matmuls with the forward); the mode two."""
    g = torch.Generator().manual_seed(0)
    x, dx = (torch.randn(16, 8, generator=g) for _ in range(2))
    layer = torch.nn.Linear(8, 12)
    assert matmuls(lambda: dual_call(layer, (x,), (dx,), fast=False)) == 3
    assert matmuls(lambda: dual_call(layer, (x,), (dx,), fast=True)) == 2


def test_calls_it_does_not_cover_keep_pytorchs_path():
    """A weight or bias with a tangent of its own, a bias passed by keyword, an input without a tangent."""
    g = torch.Generator().manual_seed(0)
    x, dx, w, dw, b, db = (torch.randn(shape, generator=g, dtype=torch.float64)
                           for shape in ((5, 3), (5, 3), (4, 3), (4, 3), (4,), (4,)))
    for fn, primals, tangents in [(F.linear, (x, w), (dx, dw)), (F.linear, (x, w, b), (dx, torch.zeros_like(w), db)),
                                  (lambda x, b: F.linear(x, w, bias=b), (x, b), (dx, db)),
                                  (lambda x: F.linear(x, w, bias=b), (x,), (dx,))]:
        out, tangent = dual_call(fn, primals, tangents, fast=True)
        expected_out, expected_tangent = dual_call(fn, primals, tangents, fast=False)
        torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
        torch.testing.assert_close(tangent, expected_tangent, rtol=1e-14, atol=1e-14)
    with torch.no_grad(), fwAD.dual_level(), linear_tangents():  # no tangent anywhere: a plain tensor out
        out = F.linear(x, w, b)
        assert fwAD.unpack_dual(out).tangent is None
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=0)
