"""Codecs: what a gradient bucket looks like on the wire.

A codec is one axis of a synchronization scheme (see ``docs/architecture.md``), independent of the transport:
it runs a transport's exchanges on an encoded form of the bucket and decodes the result into the bucket, so
every strategy gains a new codec by taking one more class, the way DDP's communication hooks wrap a bucket's
all-reduce. A codec that compresses keeps its own state per bucket (residuals for error feedback, low-rank
factors), which :meth:`Codec.state_dict` hands to checkpoints.

- :class:`Codec` (``"none"``): the bucket travels as it is.
- :class:`HalfPrecisionCodec` (``"fp16"``, ``"bf16"``): 16 bits per element each way, with error feedback.
- :class:`PowerSGDCodec` (``"powersgd"``): rank-``r`` factors of every matrix-shaped gradient (Vogels et al.,
  NeurIPS 2019), with error feedback and warm start.

:func:`make_codec` builds one by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.transports import Transport

#: the ``compression`` option's values
CODEC_NAMES = ("none", "fp16", "bf16", "powersgd")


class Codec:
    """The bucket travels as it is (full precision): the transport's exchanges unchanged.

    The life of a codec: :meth:`bind` once the transport laid out the buckets; per synchronization
    :meth:`reduce` (gradients up), and where every rank needs the averaged gradients :meth:`share`; for the
    parameter servers, per step, :meth:`before_update` on the owners just before they run the optimizer and
    :meth:`share_weights` once the owners packed their new weights into the bucket. A lossy codec must keep the
    residuals of the two directions apart.
    """

    name = "none"
    #: whether :meth:`share_weights` may leave values on an owner that differ from its parameters (then every rank,
    #: owners included, takes the weights from the bucket)
    rewrites_weights = False

    def bind(self, buckets: Sequence[GradientBucket], transport: Transport) -> None:
        """Prepare for ``buckets`` travelling over ``transport`` (every rank, the same buckets)."""

    def reduce(self, bucket: GradientBucket, transport: Transport) -> None:
        """Average ``bucket`` over the ranks through ``transport`` (see :meth:`Transport.reduce`)."""
        transport.reduce(bucket)

    def share(self, bucket: GradientBucket, transport: Transport) -> None:
        """Send the owners' averaged gradients of ``bucket`` to every rank (see :meth:`Transport.share`)."""
        transport.share(bucket)

    def before_update(self, bucket: GradientBucket, transport: Transport) -> None:
        """An owner is about to run the optimizer on its part of ``bucket``'s parameters."""

    def share_weights(self, bucket: GradientBucket, transport: Transport) -> None:
        """The owners packed their updated weights into ``bucket``: leave on every rank the weights it must take."""
        transport.share(bucket)

    def wire_bytes(self, bucket: GradientBucket) -> int:
        """Bytes one rank's contribution of ``bucket`` takes on the wire (once compression is running)."""
        return bucket.nbytes

    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (CPU tensors), for a checkpoint; empty when the codec keeps none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after :meth:`bind`); raises ``ValueError``, changing nothing, when it does not
        fit the buckets."""


def check_compressible(buckets: Sequence[GradientBucket], name: str) -> None:
    """Refuse compression ``name`` for gradients narrower than float32 (with a message naming the option)."""
    narrow = sorted({str(b.buffer.dtype) for b in buckets if b.buffer.dtype not in (torch.float32, torch.float64)})
    if narrow:
        raise ConfigurationError(
            f"compression={name!r} encodes float32 gradients, but some of the model's gradients are {narrow[0]} "
            "(a 16-bit '-true' precision): they already travel in 16 bits. Use compression='none', or a '-mixed' "
            "precision."
        )


def _drop_nonfinite(state: Tensor) -> None:
    """Zero what an overflowing step (inf/NaN gradients, skipped by a gradient scaler) left in a codec's state, so
    that it does not poison every later step."""
    torch.nan_to_num_(state, nan=0.0, posinf=0.0, neginf=0.0)


def _check_fits(saved: dict[int, Tensor], into: dict[int, Tensor], what: str) -> None:
    if sorted(saved) != sorted(into) or any(saved[b].shape != into[b].shape for b in into):
        raise ValueError(f"the saved {what} do not fit this run's gradient buckets")


def _restore(saved: dict[int, Tensor], into: dict[int, Tensor]) -> None:
    for b, tensor in into.items():
        tensor.copy_(saved[b])


class HalfPrecisionCodec(Codec):
    """Buckets travel in 16 bits (``torch.float16`` or ``torch.bfloat16``), half the bytes of float32.

    Gradients up: each rank divides its bucket by the group size (so that 16-bit partial sums cannot overflow
    where the average would not), adds its residual from the last step (error feedback, unless
    ``error_feedback=False``), rounds to 16 bits and keeps what the rounding lost as the next residual; the
    transport then sums the 16-bit contributions, adding in float32 where a rank adds what arrived (the servers
    add every contribution in float32; the ring's partial sums are rounded at each hop, since they travel).
    Averaged gradients down (the ring's second phase, the servers' full-gradient mode) are rounded once more, on
    every rank alike. Every rounding a rank makes on the way (its contribution, the partial sums it forwards,
    the averages it owns) goes into its residual, so the sum of the averages applied over the steps stays within
    one step's rounding of the exact sum. Used-flags are rounded but never carry residuals.

    Weights down (parameter servers): the owner keeps the weights in full precision (``master``) and every rank,
    the owner included, trains on a replica that moves by 16-bit steps: after each update the owner sends the
    16-bit rounding of ``master - replica`` and every rank adds it to its replica. What one step's rounding
    loses is part of the next step's difference, so no update is lost, however small against the weight; the
    replicas stay bit-identical, and differ from the owner's full-precision weights by less than one 16-bit
    rounding of that difference. The optimizer steps on the full-precision weights; forward and backward run on
    the replica.
    """

    rewrites_weights = True

    def __init__(self, dtype: torch.dtype = torch.bfloat16, error_feedback: bool = True) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ConfigurationError(f"HalfPrecisionCodec takes torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self.error_feedback = error_feedback
        self.size = 1
        #: per bucket index: the gradients' rounding residual (divided by the group size, as sent)
        self.residuals: dict[int, Tensor] = {}
        #: per bucket index: residuals of parameters this rank did not use lately, and which parameters they are
        self.held: dict[int, Tensor] = {}
        self.holding: dict[int, set[int]] = {}
        self._grad_numel: dict[int, int] = {}
        #: per bucket index, on an owner: its full-precision weights, and the replica they were last seen at
        self.master: dict[int, Tensor] = {}
        self._replica: dict[int, Tensor] = {}
        #: per bucket index, on an owner: the replica weights the last weight exchange left on every rank
        self._sent: dict[int, Tensor] = {}
        self._owned: dict[int, tuple[int, int]] = {}
        self._device = torch.device("cpu")

    def bind(self, buckets: Sequence[GradientBucket], transport: Transport) -> None:
        super().bind(buckets, transport)
        check_compressible(buckets, self.name)
        self.size = transport.size
        if self.error_feedback:
            self.residuals = {b.index: torch.zeros_like(b.buffer) for b in buckets}
        self.held, self.holding = {}, {}
        self._grad_numel = {b.index: b.grad_numel for b in buckets}
        self.master, self._replica, self._sent = {}, {}, {}
        self._owned = {b.index: transport.owned(b) for b in buckets}
        self._device = buckets[0].buffer.device if buckets else torch.device("cpu")

    def _master_of(self, bucket: GradientBucket, start: int, end: int) -> Tensor:
        """The owner's full-precision weights of ``bucket``, created from the parameters on first use (only the
        parameter servers' owners ever hold them)."""
        if bucket.index not in self.master:
            self.master[bucket.index] = bucket.read_params(start, end, torch.empty_like(bucket.buffer[start:end]))
        return self.master[bucket.index]

    def _round(self, values: Tensor) -> None:
        values.copy_(values.to(self.dtype))

    def reduce(self, bucket: GradientBucket, transport: Transport) -> None:
        values = bucket.buffer  # gradients, then used-flags; residuals of flags are always dropped
        residual = self.residuals.get(bucket.index)
        if residual is not None:
            self._hold_unused(bucket, residual)
        values.div_(self.size)
        if residual is not None:
            values.add_(residual)
            residual.copy_(values)
            self._round(values)
            residual.sub_(values)
        else:
            self._round(values)
        transport.reduce(bucket, wire=self.dtype, residual=residual)
        if residual is not None:
            residual[bucket.grad_numel :].zero_()
            _drop_nonfinite(residual)

    def _hold_unused(self, bucket: GradientBucket, residual: Tensor) -> None:
        """Move the residual of each parameter this rank did not use into :attr:`held` (sent now, it could be dropped
        with a gradient no rank used), and give it back on the next step that uses the parameter. Only what this
        rank's own gradient left is held: the transport's roundings stay in ``residual`` and leave next step."""
        holding = self.holding.setdefault(bucket.index, set())
        if not holding and bool(bucket.flags.all()):
            return
        held = self.held.setdefault(bucket.index, torch.zeros_like(residual[: bucket.grad_numel]))
        for i, used in enumerate((bucket.flags != 0).tolist()):
            lo, hi = bucket.slices[i]
            if not used:
                held[lo:hi].add_(residual[lo:hi])
                residual[lo:hi].zero_()
                holding.add(i)
            elif i in holding:
                residual[lo:hi].add_(held[lo:hi])
                held[lo:hi].zero_()
                holding.discard(i)

    def share(self, bucket: GradientBucket, transport: Transport) -> None:
        residual = self.residuals.get(bucket.index)
        transport.share(bucket, wire=self.dtype, residual=residual)
        if residual is not None:
            residual[bucket.grad_numel :].zero_()
            _drop_nonfinite(residual)

    def before_update(self, bucket: GradientBucket, transport: Transport) -> None:
        start, end = transport.owned(bucket)
        if end <= start:
            return
        master = self._master_of(bucket, start, end)
        replica = bucket.read_params(start, end, torch.empty_like(master))
        self._follow_edits(bucket.index, master, replica)
        self._replica[bucket.index] = replica
        bucket.write_params(start, end, master)

    def _follow_edits(self, index: int, master: Tensor, replica: Tensor) -> None:
        """Weights written outside the optimizer since the last exchange (clamping, projections, a callback) move
        the full-precision weights too, as they would move the weights under ``ddp``."""
        sent = self._sent.get(index)
        if sent is not None:
            master.add_(replica - sent)

    def share_weights(self, bucket: GradientBucket, transport: Transport) -> None:
        start, end = transport.owned(bucket)
        new_replica: Tensor | None = None
        if end > start:
            master = self._master_of(bucket, start, end)
            packed = bucket.buffer[start:end]
            replica = self._replica.pop(bucket.index, None)
            if replica is None:  # no update since the last pull: the parameters are the replica
                replica = packed.clone()
                self._follow_edits(bucket.index, master, replica)
            else:
                master.copy_(packed)
            step = master - replica
            self._round(step)
            packed.copy_(step)
            new_replica = replica.add_(step)
        transport.share(bucket, wire=self.dtype)
        # every rank: its replica plus the owners' 16-bit steps (an owner's parameters hold the master just now)
        steps = bucket.buffer[: bucket.grad_numel].clone()
        bucket.pack_params()
        bucket.buffer[: bucket.grad_numel].add_(steps)
        if new_replica is not None:
            bucket.buffer[start:end].copy_(new_replica)
            self._sent[bucket.index] = new_replica

    def wire_bytes(self, bucket: GradientBucket) -> int:
        return bucket.buffer.numel() * torch.empty((), dtype=self.dtype).element_size()

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {b: t.cpu().clone() for b, t in self.residuals.items()},
            "held": {b: t.cpu().clone() for b, t in self.held.items()},
            "holding": {b: sorted(h) for b, h in self.holding.items()},
            "master": {b: t.cpu().clone() for b, t in self.master.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residuals, master = state.get("residuals", {}), state.get("master", {})
        _check_fits(residuals, self.residuals, "error-feedback residuals")
        for b, tensor in master.items():
            start, end = self._owned.get(b, (0, 0))
            if tensor.shape != (end - start,):
                raise ValueError("the saved full-precision weights do not fit the part of the buckets this rank serves")
        held = state.get("held", {})
        if any(t.shape != (self._grad_numel.get(b, -1),) for b, t in held.items()):
            raise ValueError("the saved held residuals do not fit this run's gradient buckets")
        _restore(residuals, self.residuals)
        self.held = {b: t.to(self._device, copy=True) for b, t in held.items()}
        self.holding = {b: set(h) for b, h in state.get("holding", {}).items()}
        self.master = {b: t.to(self._device, copy=True) for b, t in master.items()}
        self._replica, self._sent = {}, {}


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
    orthogonal to the others instead of as amplified rounding noise. The same steps on every rank: same bits."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        if i:
            done = matrix[:, :i]
            for _ in range(2):
                col.sub_(done @ (done.t() @ col))
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
        self._everywhere: dict[int, bool] = {}

    def bind(self, buckets: Sequence[GradientBucket], transport: Transport) -> None:
        super().bind(buckets, transport)
        check_compressible(buckets, self.name)
        self.plans = {b.index: _LowRankPlan(b, self.rank, self.min_compression_rate) for b in buckets}
        self.steps = {b.index: 0 for b in buckets}
        self.residuals = {}
        self.factors = {}
        for b in buckets:
            plan = self.plans[b.index]
            if self.error_feedback and plan.matrices:
                self.residuals[b.index] = torch.zeros_like(b.buffer[: b.grad_numel])
            self.factors[b.index] = self._initial_factors(b)

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
        self._everywhere[index] = compressing
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
        transport.all_reduce(first, bucket)
        for p, q, m in zip(ps, qs, ms):
            _orthogonalize(p)
            torch.matmul(m.t(), p, out=q)
        transport.all_reduce(q_all, bucket)
        # decode into the bucket: uncompressed parts, flags, and P Q^T; the residual is what P Q^T missed
        out = bucket.buffer
        offset = 0
        for start, end in plan.plain:
            out[start:end].copy_(first[offset : offset + end - start])
            offset += end - start
        bucket.flags.copy_(first[offset : plan.plain_numel])
        used = (bucket.flags != 0).tolist()  # the same on every rank: the flags were averaged
        fresh: Tensor | None = None
        q_offset = 0
        for (start, rows, cols, r), i, p, q, m in zip(plan.matrices, plan.matrix_params, ps, qs, ms):
            approximation = out[start : start + rows * cols].view(rows, cols)
            torch.matmul(p, q.t(), out=approximation)
            # a gradient no rank used is dropped after this exchange: its residual waits for a step that uses it
            if residual is not None and used[i]:
                residual[start : start + rows * cols].view(rows, cols).copy_(m).sub_(approximation)
            # a zero column (a gradient of lower rank than r) or a non-finite one (overflow) of Q would stay so as the
            # next warm start: those columns start over
            dead = ~q.any(0) | ~torch.isfinite(q).all(0)
            if bool(dead.any()):
                fresh = self._initial_factors(bucket) if fresh is None else fresh
                q[:, dead] = fresh[q_offset : q_offset + cols * r].view(cols, r)[:, dead]
            q_offset += cols * r
        if residual is not None:
            _drop_nonfinite(residual)

    def share(self, bucket: GradientBucket, transport: Transport) -> None:
        if not self._everywhere.get(bucket.index, False):
            transport.share(bucket)

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
        _check_fits(state.get("residuals", {}), self.residuals, "error-feedback residuals")
        _check_fits(state.get("factors", {}), self.factors, "PowerSGD factors")
        _restore(state["residuals"], self.residuals)
        _restore(state["factors"], self.factors)
        self.steps = dict(state["steps"])


def make_codec(
    name: str, error_feedback: bool = True, powersgd_rank: int = 4, powersgd_warmup_steps: int = 10
) -> Codec:
    """The codec of the ``compression`` option ``name`` (one of :data:`CODEC_NAMES`)."""
    if name == "none":
        return Codec()
    if name in ("fp16", "bf16"):
        return HalfPrecisionCodec(torch.float16 if name == "fp16" else torch.bfloat16, error_feedback)
    if name == "powersgd":
        return PowerSGDCodec(powersgd_rank, powersgd_warmup_steps, error_feedback)
    allowed = ", ".join(map(repr, CODEC_NAMES))
    raise ConfigurationError(f"compression={name!r} is not supported; allowed values: {allowed}")


def compression_ratio(codec: Codec, buckets: Sequence[GradientBucket]) -> float:
    """Bytes on the wire with ``codec`` over bytes without it, for ``buckets`` (after any warm-up)."""
    total = sum(b.nbytes for b in buckets)
    return sum(codec.wire_bytes(b) for b in buckets) / total if total else 1.0


__all__ = [
    "CODEC_NAMES",
    "Codec",
    "HalfPrecisionCodec",
    "PowerSGDCodec",
    "check_compressible",
    "compression_ratio",
    "make_codec",
]
