"""16-bit buckets on the wire (``"fp16"``, ``"bf16"``), with error feedback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.codecs.base import Codec, check_compressible, encoding_transport
from lightning_dp.comm.codecs.state import check_fits, drop_nonfinite, restore_state
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.transports.base import Transport


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
        encoding_transport(transport, self.name)
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
            residual[bucket.grad_numel :].zero_()  # (an exchange abandoned half-way may have left some)
            self._hold_unused(bucket, residual)
        values.div_(self.size)
        if residual is not None:
            values.add_(residual)
            residual.copy_(values)
            self._round(values)
            residual.sub_(values)
        else:
            self._round(values)
        encoding_transport(transport, self.name).reduce_encoded(bucket, self.dtype, residual)
        if residual is not None:
            residual[bucket.grad_numel :].zero_()
            drop_nonfinite(residual)

    def _hold_unused(self, bucket: GradientBucket, residual: Tensor) -> None:
        """Move the residual of each parameter this rank did not use into :attr:`held` (sent now, it could be dropped
        with a gradient no rank used), and give it back on the next step that uses the parameter. Only what this
        rank's own gradient left is held: the transport's roundings stay in ``residual`` and leave next step."""
        holding = self.holding.setdefault(bucket.index, set())
        if not holding and all(bucket.used):  # this rank's own flags, as the host wrote them
            return
        held = self.held.setdefault(bucket.index, torch.zeros_like(residual[: bucket.grad_numel]))
        for i, used in enumerate(bucket.used):
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
        encoding_transport(transport, self.name).share_encoded(bucket, self.dtype, residual)
        if residual is not None:
            residual[bucket.grad_numel :].zero_()
            drop_nonfinite(residual)

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
        encoding_transport(transport, self.name).share_encoded(bucket, self.dtype, None)
        # every rank: its replica plus the owners' 16-bit steps (an owner's parameters hold the master just now)
        steps = bucket.buffer[: bucket.grad_numel].clone()
        bucket.pack_params()
        bucket.buffer[: bucket.grad_numel].add_(steps)
        if new_replica is not None:
            bucket.buffer[start:end].copy_(new_replica)
            self._sent[bucket.index] = new_replica

    @property
    def keeps_residuals(self) -> bool:
        return self.error_feedback

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
        check_fits(residuals, self.residuals, "error-feedback residuals")
        for b, tensor in master.items():
            start, end = self._owned.get(b, (0, 0))
            if tensor.shape != (end - start,):
                raise ValueError("the saved full-precision weights do not fit the part of the buckets this rank serves")
        held = state.get("held", {})
        if any(t.shape != (self._grad_numel.get(b, -1),) for b, t in held.items()):
            raise ValueError("the saved held residuals do not fit this run's gradient buckets")
        restore_state(residuals, self.residuals)
        self.held = {b: t.to(self._device, copy=True) for b, t in held.items()}
        self.holding = {b: set(h) for b, h in state.get("holding", {}).items()}
        self.master = {b: t.to(self._device, copy=True) for b, t in master.items()}
        self._replica, self._sent = {}, {}
