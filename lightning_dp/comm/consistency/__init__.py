"""Bounded staleness (SSP) and asynchronous parameter servers: every worker pushes and pulls at its own pace.

The synchronous schemes make every step of every rank wait for every rank's gradients. Here a server applies each
worker's gradient as soon as it arrives, and a worker waits only for what its consistency model demands:

- ``staleness=k`` (Stale Synchronous Parallel, Ho et al. 2013): a worker about to compute its step ``c`` (its
  *clock*: the number of gradients it has pushed) reads weights that hold every worker's updates of steps
  ``0 .. c - k - 1`` at least; it blocks only when a slower worker would break that. ``k = 0`` is synchronous.
- ``staleness=None``: asynchronous; a worker never waits for another.

The staleness a worker sees at step ``c`` is ``c - m``, where ``m`` is the smallest clock among the workers whose
updates its weights hold (``m`` steps of every worker are in them); SSP keeps it at most ``k``.

Each arriving gradient is applied alone, as one step of the user's optimizer on a batch ``N`` times smaller than the
synchronous step's, with the learning rate scaled as the batch-size scaling rules say keeps the training the same
(:func:`~.protocol.arrival_lr_scale`): ``lr / N`` for SGD and the other optimizers linear in the gradient (the
linear scaling rule: ``N`` arrivals move the weights as far as one synchronous step of their average), ``lr /
sqrt(N)`` for the adaptive ones (Adam, RMSprop, ...), whose step is normalized by the gradient's running RMS, which
one worker's smaller batch makes ``sqrt(N)`` times noisier (the square-root scaling rule for adaptive optimizers).
Decoupled weight decay (AdamW's) is scaled so that a round of ``N`` arrivals decays the weights as one synchronous
step does. No delay compensation is applied to stale gradients.

Roles (every rank is a worker; a rank that serves a share of the weights also runs a
:class:`~.server.StalenessServer`):

- :class:`~.protocol.PushLayout`: which elements of the flat gradient buckets each server serves, and a message's
  layout: the served elements of every bucket in bucket order, then every bucket's used-flags.
- :class:`StalenessServer`: a serving thread with its own copy of its share of the weights and the optimizer
  state (a :class:`~lightning_dp.comm.servers.sharded_optimizer.ShardedOptimizer` over a
  :class:`~lightning_dp.comm.servers.sharded_optimizer.ShardLayout` with its own storage), fed by one receiving thread
  per remote worker, so it keeps serving while its rank trains.
- :class:`StalenessClient`: a worker's side: :meth:`~StalenessClient.push` sends the gradients to every server and
  returns once the new weights satisfying the bound are in the parameters; :meth:`~StalenessClient.flush` (every
  worker at the same clock, e.g. before validation or a checkpoint) gives every worker the same weights, holding
  every update.

Messages travel on two process groups of their own (gloo), ``push_group`` from workers to servers and
``reply_group`` back, both meant to be created with a long timeout: a server waits for a worker's next message
however long the worker validates, and a flush waits for the slowest worker's remaining steps; a push's own waits
are bounded by the client's ``timeout``. A dead peer's closed sockets end any wait at once. A worker that dies,
aborts or pushes a non-finite gradient makes every server answer every later request with a failure naming it, so
no worker waits for it; a worker that finished (said goodbye) holds nobody back any more.
"""

from lightning_dp.comm.consistency.client import StalenessClient
from lightning_dp.comm.consistency.protocol import (
    PushLayout,
    StalenessRecord,
    StopReason,
    arrival_lr_scale,
    arrival_scale,
    check_staleness,
)
from lightning_dp.comm.consistency.server import StalenessServer

__all__ = [
    "PushLayout",
    "StalenessClient",
    "StalenessRecord",
    "StalenessServer",
    "StopReason",
    "arrival_lr_scale",
    "arrival_scale",
    "check_staleness",
]
