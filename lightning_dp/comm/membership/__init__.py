"""Membership: which ranks train now, and how the survivors of a lost rank agree to go on without it.

:class:`Membership` is the one object every exchange consults (see :mod:`.membership`); beneath it the control
plane (:mod:`.control`: heartbeats and the agreement's messages), the agreement (:mod:`.agreement`) and the fence
that ends a process group's waits at once (:mod:`.fence`).
"""

from lightning_dp.comm.membership.agreement import Agreement, Decision, choose_members, quorum_problem
from lightning_dp.comm.membership.control import ControlPlane
from lightning_dp.comm.membership.fence import connections_opened_by, fence
from lightning_dp.comm.membership.membership import Join, Leave, Loss, Membership, form_group, read_directory

__all__ = [
    "Agreement",
    "ControlPlane",
    "Decision",
    "Join",
    "Leave",
    "Loss",
    "Membership",
    "choose_members",
    "connections_opened_by",
    "fence",
    "form_group",
    "quorum_problem",
    "read_directory",
]
