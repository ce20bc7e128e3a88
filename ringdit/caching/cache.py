"""``StepCache``: wraps a model's repeated blocks for one sampling run and decides, with one all-reduce, which samples
reuse their cached residual (see ``ringdit.caching``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ringdit.caching.blocks import BlockIO, block_io, modulated_input_of, repeated_blocks_of
from ringdit.caching.cache_settings import CacheSettings
from ringdit.common.errors import ConfigError

Tensor = torch.Tensor


@dataclass
class CacheCounts:
    """Model evaluations of all runs so far: ``evaluations`` calls of the model, ``full`` of them ran every block."""

    evaluations: int = 0
    full: int = 0

    @property
    def reused(self) -> int:
        return self.evaluations - self.full


class _Run:
    """The state of one sampling run (one ``attached`` block): dropped when it ends."""

    def __init__(self, pairs: bool):
        self.pairs = pairs  # CFG in one batch: rows i and i + B/2 are one sample's two halves
        self.evaluation = 0
        self.rows: int | None = None  # the batch's rows: another count starts the cache afresh
        self.reuse_rows: Tensor | None = None  # (rows,) bool: this evaluation, which rows take the cached residual
        self.reuse_all = False  # every row does: the blocks after the probe are skipped
        self.base: tuple[Tensor, Tensor | None] | None = None  # where the residual is measured from, this evaluation
        self.residual: tuple[Tensor, Tensor | None] | None = None  # cached: the skipped blocks' contribution
        self.reference: Tensor | None = None  # fbcache: first-block residual of the last full evaluation;
        # teacache: the previous evaluation's modulated input
        self.accumulated: Tensor | None = None  # teacache: (samples,) rescaled change since the last full evaluation
        self.records: list[tuple[Tensor, Tensor]] = []  # calibrate: (input change, residual change) per sample
        self.previous_residual: Tensor | None = None  # calibrate: the last evaluation's residual
        self.pending_change: Tensor | None = None  # calibrate: this evaluation's input change, until its residual


class StepCache:
    """Attach a step cache to a model for one sampling run: ``with cache.attached(model, dims, pairs=...):``.

    ``dims``: the ``ParallelDims`` the model runs on (its SP group, and its CFG-parallel pair). ``calibrate=True``:
    run every block and record (modulated input change, residual change) per sample and evaluation, for
    ``fit_coefficients``.
    """

    def __init__(self, settings: CacheSettings, coefficients: tuple[float, ...] | None = None, *,
                 calibrate: bool = False):
        if settings.kind == "teacache" and coefficients is None and not calibrate:
            raise ConfigError("cache=teacache needs its coefficients (see ringdit.caching.teacache_coefficients)")
        self.settings, self.coefficients, self.calibrate = settings, coefficients, calibrate
        self.counts = CacheCounts()
        self.records: list[tuple[float, float]] = []  # calibrate: every run's (input change, residual change)
        self._run: _Run | None = None
        self._dims = None
        self._sequence = None

    @contextlib.contextmanager
    def attached(self, model: nn.Module, dims=None, *, pairs: bool = False):
        """Wrap the model's repeated blocks for one run; ``pairs``: the batch holds both guidance halves (rows i and
        i + B/2 are one sample). Collective under sequence parallelism, like the sampling it wraps."""
        if not (self.settings.enabled or self.calibrate):
            yield self
            return
        blocks = repeated_blocks_of(model)
        self._dims, self._sequence = dims, model._ringdit_sequence
        self._run, self._last = _Run(pairs), len(blocks) - 1
        probe = modulated_input_of(model) if self.settings.kind == "teacache" or self.calibrate else None
        declared = model.cache_blocks
        wrapped = []  # (block, its own instance forward, if it had one)
        try:
            for index, block in enumerate(blocks):
                io = block_io(block, declared)
                wrapped.append((block, block.__dict__.get("forward")))
                block.forward = _bound(self, index, block, io, block.forward, probe)
            yield self
        finally:
            for block, own in wrapped:
                if own is None:
                    del block.forward  # the class's forward again
                else:
                    block.forward = own
            if self.calibrate:
                self.records += [(float(a), float(b)) for x, y in self._run.records for a, b in zip(x, y)]
            self._run = None

    # ---- one block call --------------------------------------------------------------------------------------------
    def _block(self, index: int, block: nn.Module, io: BlockIO, original, probe, args: tuple, kwargs: dict):
        run = self._run
        if index == 0:
            out = self._first(block, io, original, probe, args, kwargs)
        elif run.reuse_all:
            out = io.output(*io.inputs(block, args, kwargs))  # skipped: its contribution is in the cached residual
        else:
            out = original(*args, **kwargs)
        if index == self._last:
            out = self._finish(io, out)
        return out

    def _first(self, block, io, original, probe, args, kwargs):
        """The probe: decide, for this evaluation, which samples reuse the cached residual."""
        run = self._run
        run.evaluation += 1
        self.counts.evaluations += 1
        hidden, encoder = io.inputs(block, args, kwargs)
        rows = hidden.shape[0]
        if run.rows != rows:  # a new batch shape: nothing cached fits it
            run.rows, run.residual, run.reference, run.accumulated, run.previous_residual = rows, None, None, None, None
        fresh = run.residual is None or run.evaluation <= self.settings.warmup
        reuse = torch.zeros(self._deciders(rows), dtype=torch.bool)
        if self.settings.kind == "fbcache" and not self.calibrate:
            out = original(*args, **kwargs)
            out_hidden, out_encoder = io.outputs(out)
            residual = out_hidden - hidden  # (rows, S_local, D)
            if not fresh:
                change, previous = self._sums(residual - run.reference, run.reference, sharded=True)
                reuse = change / previous < self.settings.threshold  # NaN (0 / 0) is False: compute
            rows_reuse = self._per_row(reuse, residual.device)
            run.reference = residual if run.reference is None else torch.where(
                _expand(rows_reuse, residual), run.reference, residual)
            run.base = (out_hidden, out_encoder)
        else:  # teacache, or calibration: the modulated input, before any block runs
            current, sharded = probe(block, io, args, kwargs)
            change = None
            if run.reference is not None:
                change, previous = self._sums(current - run.reference, run.reference, sharded=sharded)
                change = change / previous  # (samples,) relative L1 change since the previous evaluation
            run.reference = current
            if self.calibrate:
                run.pending_change = change
            else:
                accumulated = run.accumulated if run.accumulated is not None else \
                    torch.zeros(self._deciders(rows), dtype=torch.float64)
                if not fresh and change is not None:
                    accumulated = accumulated + _polyval(self.coefficients, change)
                    reuse = accumulated < self.settings.threshold  # NaN is False: compute
                run.accumulated = torch.where(reuse, accumulated, torch.zeros_like(accumulated))
            run.base = (hidden, encoder)
            out = None
        run.reuse_rows = self._per_row(reuse, hidden.device)
        run.reuse_all = bool(reuse.all())
        if not run.reuse_all:
            self.counts.full += 1
        if out is None:
            out = io.output(hidden, encoder) if run.reuse_all else original(*args, **kwargs)
        return out

    def _finish(self, io: BlockIO, out):
        """After the last block: the output is base + cached residual where a sample reuses; the residual is
        refreshed where it computed."""
        run = self._run
        base_hidden, base_encoder = run.base
        if run.reuse_all:
            cached_hidden, cached_encoder = run.residual
            return io.output(base_hidden + cached_hidden,
                             None if base_encoder is None else base_encoder + cached_encoder)
        hidden, encoder = io.outputs(out)
        fresh = (hidden - base_hidden, None if encoder is None else encoder - base_encoder)
        if self.calibrate:
            self._record(fresh[0])
        if run.residual is None or not bool(run.reuse_rows.any()):
            run.residual = fresh
            return out
        # some samples reuse: they take base + their cached residual (as if the batch had skipped) and keep it
        mask = _expand(run.reuse_rows, hidden)
        hidden = torch.where(mask, base_hidden + run.residual[0], hidden)
        new_hidden = torch.where(mask, run.residual[0], fresh[0])
        if encoder is not None:
            mask_e = _expand(run.reuse_rows, encoder)
            encoder = torch.where(mask_e, base_encoder + run.residual[1], encoder)
            new_encoder = torch.where(mask_e, run.residual[1], fresh[1])
        run.residual = (new_hidden, None if encoder is None else new_encoder)
        return io.output(hidden, encoder)

    def _record(self, residual: Tensor) -> None:
        run = self._run
        change = run.pending_change
        if run.previous_residual is not None and change is not None:
            out_change, previous = self._sums(residual - run.previous_residual, run.previous_residual, sharded=True)
            run.records.append((change, out_change / previous))
        run.previous_residual = residual

    # ---- the one collective ----------------------------------------------------------------------------------------
    def _deciders(self, rows: int) -> int:
        """How many decisions an evaluation takes: one per sample (a sample's two guidance halves together), or one."""
        if self.settings.scope == "batch":
            return 1
        return rows // 2 if self._run.pairs else rows

    def _per_row(self, decisions: Tensor, device) -> Tensor:
        """(rows,) from one decision per sample, or from the batch's one."""
        if self.settings.scope == "batch":
            return decisions.expand(self._run.rows).to(device)
        return (decisions.repeat(2) if self._run.pairs else decisions).to(device)

    def _sums(self, change: Tensor, previous: Tensor, *, sharded: bool) -> tuple[Tensor, Tensor]:
        """(sum |change|, sum |previous|) per sample (float64, on the CPU), over every rank's real tokens."""
        local = torch.stack([self._local_sum(change, sharded), self._local_sum(previous, sharded)])  # (2, rows)
        if self.settings.scope == "batch":
            local = local.sum(1, keepdim=True)  # (2, 1)
        elif self._run.pairs:
            local = local.view(2, 2, -1).sum(1)  # (2, samples): a sample's two guidance halves together
        return tuple(self._all_reduce(local))

    def _local_sum(self, x: Tensor, sharded: bool) -> Tensor:
        """(rows,) sum of |x| over this rank's real tokens of x (rows, S_local, ...)."""
        x = x.abs().to(torch.float64)
        if sharded:
            x = x[:, : self._real_tokens(x.shape[1])]
        return x.flatten(1).sum(1)

    def _real_tokens(self, local: int) -> int:
        """How many of this rank's ``local`` tokens are real (the last ranks hold the tail padding)."""
        state = self._sequence
        if state is None or state.length is None:
            return local
        rank = state.dims.sp_rank if state.dims.sp_degree > 1 else 0
        return max(0, min(local, state.length - rank * local))

    def _all_reduce(self, local: Tensor) -> Tensor:
        """ONE all-reduce (sum) over the ranks that hold parts of these samples: the SP group, and the CFG pair."""
        dims = self._dims
        group = None if dims is None else _reduce_group(dims)
        if group is None:
            return local
        import torch.distributed as dist

        device = _collective_device(group)
        summed = local.to(device)
        dist.all_reduce(summed, group=group)
        return summed.cpu()


def _reduce_group(dims):
    """The group one sample's tokens and guidance halves are spread over: SP, CFG pair, or both (cfg_sp_group)."""
    if dims.cfg_group is not None and dims.sp_degree > 1:
        return dims.cfg_sp_group
    return dims.cfg_group if dims.cfg_group is not None else dims.sp_group if dims.sp_degree > 1 else None


def _collective_device(group) -> torch.device:
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _bound(cache: StepCache, index, block, io, original, probe):
    def forward(*args, **kwargs):
        return cache._block(index, block, io, original, probe, args, kwargs)

    return forward


def _expand(rows: Tensor, like: Tensor) -> Tensor:
    return rows.to(like.device).view(-1, *[1] * (like.dim() - 1))


def _polyval(coefficients: tuple[float, ...], x: Tensor) -> Tensor:
    """numpy.polyval in float64 (Horner)."""
    result = torch.zeros_like(x, dtype=torch.float64)
    for c in coefficients:
        result = result * x + c
    return result
