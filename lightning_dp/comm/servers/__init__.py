"""Dedicated parameter servers: processes of their own (on spare CPU machines) that aggregate and update.

A run has ``n`` trainers and ``k`` server processes, the *members* of one gloo group of their own
(:class:`~.members.MemberGroup`): trainers are members ``0 .. n - 1`` (their trainer ranks), servers ``n .. n + k -
1``. Every gradient bucket is cut into ``n + k`` shares (:func:`~.split.member_segments`; under whole parameters
the buckets laid end to end are cut at parameter boundaries instead), so that each bucket's push and pull keep
every member's link busy both ways; a member serves its share: it averages that part of every trainer's gradients,
runs the user's optimizer on it (a :class:`~lightning_dp.comm.servers.sharded_optimizer.ShardedOptimizer`) and
sends the new weights to every trainer.

With per-machine bandwidth ``B``, gradient bytes ``S``, trainers that serve a share ``x`` each and servers a share
``y`` each (``n x + k y = 1``), a trainer machine sends ``(1 - x) S`` gradients plus ``(n - 1) x S`` weights of its
share, a server machine receives ``n y S`` (and sends as much back). Equal loads give the optimal split
(:func:`~lightning_dp.comm.cost.trainer_share`)::

    x = (n - k) / (n² + k n - 2 k),   y = 2 (n - 1) / (n² + k n - 2 k),
    t(n, k) = 2 n (n - 1) / (n² + k n - 2 k) · S / B      (:func:`~lightning_dp.comm.cost.dedicated_exchange_seconds`)

``k = 0`` is the sharded server on the trainers (the ring's ``2 (n - 1) / n · S / B``); from ``k = n`` on the
trainers serve nothing and a step takes ``S / B``: each trainer sends its gradients once and receives the weights
once. ``parameter_server`` with ``k`` servers uses ``x = 0``: an element-wise optimizer's buckets are cut over the
servers like any other, and any other per-parameter optimizer gets whole parameters.

Trainers' side: :class:`~.transport.DedicatedServerTransport` (a :class:`~lightning_dp.comm.transports.Transport`
for the gradient buckets, plus the control messages trainer 0 sends each step). Servers' side:
:class:`~.server.DedicatedServer`, run by ``python -m lightning_dp.server``. Per synchronization every trainer
pushes each bucket's shares to their owners during backward; per optimizer step trainer 0 sends a control message
(which optimizer, its current hyperparameters, the clipping Lightning asked for), every member takes part in one
tiny all-reduce (the gradients' squared norm for clipping by norm and a NaN/inf vote), the owners step, and every
trainer receives the new weights. When nothing between backward and the step can change the update, the servers
instead step their shares piece by piece (:attr:`~.members.MemberGroup.message_bytes`) as the pushes arrive."""

from lightning_dp.comm.servers.members import MemberGroup, run_store
from lightning_dp.comm.servers.plan import Control, ServerPlan, check_importable, optimizer_spec
from lightning_dp.comm.servers.server import DedicatedServer
from lightning_dp.comm.servers.sharded_optimizer import ShardedOptimizer, ShardLayout
from lightning_dp.comm.servers.split import member_segments, member_shares
from lightning_dp.comm.servers.transport import DedicatedServerTransport

__all__ = [
    "Control",
    "DedicatedServer",
    "DedicatedServerTransport",
    "MemberGroup",
    "ServerPlan",
    "ShardLayout",
    "ShardedOptimizer",
    "check_importable",
    "member_segments",
    "member_shares",
    "optimizer_spec",
    "run_store",
]
