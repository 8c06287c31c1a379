"""PowerSGD: rank-``r`` factors of every matrix-shaped gradient, with error feedback and warm start."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.codecs.base import Codec, check_compressible, encoding_transport
from lightning_dp.comm.codecs.state import check_fits, drop_nonfinite, restore_state
from lightning_dp.comm.transports.base import Transport


class _LowRankPlan:
    """How one bucket travels under PowerSGD: its matrix-shaped gradients as rank-``r`` factors, the rest as is."""

    def __init__(self, bucket: GradientBucket, rank: int, min_compression_rate: float) -> None:
        #: ``(start, rows, cols, r)`` of every compressed gradient, and ``(start, end)`` of every other one
        self.matrices: list[tuple[int, int, int, int]] = []
        #: the parameter (index in the bucket) of each compressed gradient
        self.matrix_params: list[int] = []
        self.plain: list[tuple[int, int]] = []
        for i, (p, (start, end)) in enumerate(zip(bucket.params, bucket.slices)):
            rows = p.shape[0] if p.dim() >= 2 else 0
            cols = p.numel() // rows if rows else 0
            r = min(rank, rows, cols)
            if rows and (rows + cols) * r * min_compression_rate <= rows * cols:
                self.matrices.append((start, rows, cols, r))
                self.matrix_params.append(i)
            else:
                self.plain.append((start, end))
        self.plain_numel = sum(e - s for s, e in self.plain) + bucket.flags.numel()
        self.p_numel = sum(rows * r for _, rows, _, r in self.matrices)
        self.q_numel = sum(cols * r for _, _, cols, r in self.matrices)


def _orthogonalize(matrix: Tensor, eps: float = 1e-8) -> None:
    """Orthonormalize the columns of ``matrix`` in place: Gram-Schmidt, each column projected out twice ("twice is
    enough"), so that a column that is numerically zero (a gradient of lower rank than the factors) still comes out
    orthogonal to the others instead of as amplified rounding noise. The same steps on every rank: same bits.

    The projections are element-wise products and sums, not matrix products: under
    ``torch.set_float32_matmul_precision("high")`` (recommended on recent GPUs) a float32 matrix product runs in TF32
    with 10 bits of mantissa, and nearly parallel columns would come out orthogonal only to about 1e-2."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        if i:
            done = matrix[:, :i]
            for _ in range(2):
                coefficients = (done * col).sum(dim=0, keepdim=True)
                col.sub_((done * coefficients).sum(dim=1, keepdim=True))
        col.div_(torch.linalg.vector_norm(col) + eps)


class PowerSGDCodec(Codec):
    """Low-rank gradients (PowerSGD, Vogels et al., NeurIPS 2019): each matrix-shaped gradient ``M`` (a tensor of
    2 or more dimensions seen as ``shape[0] x rest``) travels as two factors of rank ``r``.

    Per bucket and step: ``M`` plus its residual (error feedback); ``P = M Q`` with last step's ``Q`` (warm start;
    a seeded random matrix at first, the same on every rank); ``P`` averaged over the ranks, together with the
    gradients that stay uncompressed (vectors, and matrices where ``(n + m) r`` is not at most half of ``n m``)
    and the used-flags; ``P`` orthonormalized; ``Q = M^T P`` averaged; the average is ``P Q^T``, the same bits
    on every rank, and ``M - P Q^T`` is the next residual. A rank sends ``(n + m) r`` elements per ``n x m``
    matrix instead of ``n m`` (times the transport's factor). The first ``warmup_steps`` synchronizations of each
    bucket travel uncompressed (the paper's and torch's ``start_powerSGD_iter``). Every rank holds the average
    after :meth:`reduce`, so :meth:`share` of gradients sends nothing; weights travel uncompressed.
    """

    passes = 2
    encodes_weights = False
    #: its ``Q`` factors must be the same on every rank, and a rank one exchange behind after a loss would not have
    #: the others'
    survives_rank_loss = False

    name = "powersgd"

    def __init__(
        self, rank: int = 4, warmup_steps: int = 10, error_feedback: bool = True, min_compression_rate: float = 2.0
    ) -> None:
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.error_feedback = error_feedback
        self.min_compression_rate = min_compression_rate
        self.plans: dict[int, _LowRankPlan] = {}
        #: per bucket index: synchronizations so far, residual, and ``Q`` factors (one ``m x r`` per matrix)
        self.steps: dict[int, int] = {}
        self.residuals: dict[int, Tensor] = {}
        self.factors: dict[int, Tensor] = {}
        #: per bucket index: whether its last reduction was compressed (every rank then holds the whole average)
        self._averaged_everywhere: dict[int, bool] = {}
        #: per bucket index: its initial ``Q`` factors on the bucket's device, for columns of ``Q`` that start over
        self._fresh: dict[int, Tensor] = {}

    def bind(self, buckets: Sequence[GradientBucket], transport: Transport) -> None:
        super().bind(buckets, transport)
        check_compressible(buckets, self.name)
        encoding_transport(transport, self.name)
        self.plans = {b.index: _LowRankPlan(b, self.rank, self.min_compression_rate) for b in buckets}
        self.steps = {b.index: 0 for b in buckets}
        self.residuals = {}
        self.factors = {}
        self._fresh = {}
        for b in buckets:
            plan = self.plans[b.index]
            if self.error_feedback and plan.matrices:
                self.residuals[b.index] = torch.zeros_like(b.buffer[: b.grad_numel])
            self._fresh[b.index] = self._initial_factors(b)
            self.factors[b.index] = self._fresh[b.index].clone()

    def _initial_factors(self, bucket: GradientBucket) -> Tensor:
        """Seeded random ``Q`` factors for ``bucket``: the same on every rank."""
        generator = torch.Generator().manual_seed(1000003 * (bucket.index + 1))
        q = torch.randn(self.plans[bucket.index].q_numel, generator=generator, dtype=bucket.buffer.dtype)
        return q.to(bucket.buffer.device)

    def _compressing(self, bucket: GradientBucket) -> bool:
        return self.steps[bucket.index] >= self.warmup_steps and bool(self.plans[bucket.index].matrices)

    def reduce(self, bucket: GradientBucket, transport: Transport) -> None:
        index = bucket.index
        compressing = self._compressing(bucket)
        self.steps[index] += 1
        self._averaged_everywhere[index] = compressing
        if not compressing:
            transport.reduce(bucket)
            return
        plan = self.plans[index]
        gradients = bucket.buffer[: bucket.grad_numel].clone()
        residual = self.residuals.get(index)
        if residual is not None:
            gradients.add_(residual)
        # first message: the uncompressed gradients and the flags, then every P
        first = torch.empty(plan.plain_numel + plan.p_numel, dtype=gradients.dtype, device=gradients.device)
        offset = 0
        for start, end in plan.plain:
            first[offset : offset + end - start].copy_(gradients[start:end])
            offset += end - start
        first[offset : plan.plain_numel].copy_(bucket.flags)
        q_all = self.factors[index]
        ps, qs, ms = [], [], []
        p_offset, q_offset = plan.plain_numel, 0
        for start, rows, cols, r in plan.matrices:
            m = gradients[start : start + rows * cols].view(rows, cols)
            q = q_all[q_offset : q_offset + cols * r].view(cols, r)
            p = first[p_offset : p_offset + rows * r].view(rows, r)
            torch.matmul(m, q, out=p)
            ms.append(m)
            ps.append(p)
            qs.append(q)
            p_offset += rows * r
            q_offset += cols * r
        encoding_transport(transport, self.name).all_reduce(first, bucket)
        for p, q, m in zip(ps, qs, ms):
            _orthogonalize(p)
            torch.matmul(m.t(), p, out=q)
        encoding_transport(transport, self.name).all_reduce(q_all, bucket)
        # decode into the bucket: uncompressed parts, flags, and P Q^T; the residual is what P Q^T missed
        out = bucket.buffer
        offset = 0
        for start, end in plan.plain:
            out[start:end].copy_(first[offset : offset + end - start])
            offset += end - start
        bucket.flags.copy_(first[offset : plan.plain_numel])
        used = bucket.flags != 0  # the same on every rank: the flags were averaged
        fresh = self._fresh[index]
        q_offset = 0
        # decided on the device, element-wise: no step waits for the device to tell the host what it found
        for (start, rows, cols, r), i, p, q, m in zip(plan.matrices, plan.matrix_params, ps, qs, ms):
            approximation = out[start : start + rows * cols].view(rows, cols)
            torch.matmul(p, q.t(), out=approximation)
            # a gradient no rank used is dropped after this exchange: its residual waits for a step that uses it
            if residual is not None:
                kept = residual[start : start + rows * cols].view(rows, cols)
                kept.copy_(torch.where(used[i], m - approximation, kept))
            # a zero column (a gradient of lower rank than r) or a non-finite one (overflow) of Q would stay so as the
            # next warm start: those columns start over
            dead = ~q.any(0) | ~torch.isfinite(q).all(0)
            q.copy_(torch.where(dead, fresh[q_offset : q_offset + cols * r].view(cols, r), q))
            q_offset += cols * r
        if residual is not None:
            drop_nonfinite(residual)

    def share(self, bucket: GradientBucket, transport: Transport) -> None:
        if not self._averaged_everywhere.get(bucket.index, False):
            transport.share(bucket)

    @property
    def keeps_residuals(self) -> bool:
        return self.error_feedback

    def wire_bytes(self, bucket: GradientBucket) -> int:
        plan = self.plans.get(bucket.index) or _LowRankPlan(bucket, self.rank, self.min_compression_rate)
        if not plan.matrices:
            return bucket.nbytes
        return (plan.plain_numel + plan.p_numel + plan.q_numel) * bucket.buffer.element_size()

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": dict(self.steps),
            "residuals": {b: t.cpu().clone() for b, t in self.residuals.items()},
            "factors": {b: t.cpu().clone() for b, t in self.factors.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state.get("steps", {})) != sorted(self.steps):
            raise ValueError("the saved PowerSGD state does not fit this run's gradient buckets")
        check_fits(state.get("residuals", {}), self.residuals, "error-feedback residuals")
        check_fits(state.get("factors", {}), self.factors, "PowerSGD factors")
        restore_state(state["residuals"], self.residuals)
        restore_state(state["factors"], self.factors)
        self.steps = dict(state["steps"])
