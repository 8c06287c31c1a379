"""The errors lightning-dp raises itself: one family under :class:`LightningDPError`.

Each also derives from the built-in (or ``torch.distributed``) error a caller would catch without knowing the
project: bad options are ``ValueError``, a lost peer is ``torch.distributed.DistNetworkError``, a NaN gradient is
``FloatingPointError``.
"""

from __future__ import annotations

import torch.distributed as dist


class LightningDPError(Exception):
    """Base of the errors lightning-dp reports about a run (its options, its model, its peers, its gradients)."""


class ConfigurationError(LightningDPError, ValueError):
    """An option value, or a combination of options, model and optimizer, that the scheme does not support;
    raised at construction or set-up, before any training step."""


class UnsupportedChangeError(LightningDPError, RuntimeError):
    """The run changed something after set-up that the scheme laid out once (trainable parameters, optimizer
    groups, the number of gradient accumulations per backward)."""


class SparseGradientError(LightningDPError, RuntimeError):
    """A parameter produced a sparse gradient, which the flat buckets cannot carry."""


class ReplicaMismatchError(LightningDPError, RuntimeError):
    """Ranks hold models of different structure (names, shapes, dtypes or trainable flags)."""


class PeerUnreachableError(LightningDPError, dist.DistNetworkError):
    """A message to or from another rank failed: the peer died, the link is down, or the timeout passed."""


class MembershipChange(LightningDPError, RuntimeError):
    """A rank was lost (or the job's membership otherwise changed) while this rank exchanged or committed a step:
    the exchange was abandoned and the survivors must agree on the new membership
    (:meth:`~lightning_dp.comm.membership.Membership.recover`) before any rank exchanges again."""


class QuorumLostError(PeerUnreachableError):
    """The job cannot go on: more ranks are lost than the run allows, or this rank is on a side of a partition
    without a strict majority of the job's ranks. Raised on every rank that stops."""


class FencedError(LightningDPError, RuntimeError):
    """The job declared this rank lost (it was silent longer than the heartbeat timeout, or cut off) and went on
    without it: whatever it does now changes nothing of the job's state."""


class JoinAbandonedError(LightningDPError, RuntimeError):
    """A new process could not join the running job (a member was lost while it was admitted or handed the job's
    state, or no admission came in time); the job goes on without it, and it may be started again."""


class ForeignJobError(LightningDPError, RuntimeError):
    """A process reached the rendezvous of another job (a stray rank of an earlier launch, two jobs on one port, a
    wrong shared secret) and was refused before it touched that job."""


class NonFiniteGradientError(LightningDPError, FloatingPointError):
    """The averaged gradient of a step holds NaN or infinity; raised on every rank before the optimizer step."""


__all__ = [
    "ConfigurationError",
    "FencedError",
    "ForeignJobError",
    "JoinAbandonedError",
    "LightningDPError",
    "MembershipChange",
    "NonFiniteGradientError",
    "PeerUnreachableError",
    "QuorumLostError",
    "ReplicaMismatchError",
    "SparseGradientError",
    "UnsupportedChangeError",
]
