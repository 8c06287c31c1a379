"""``num_servers > 0`` under ``on_rank_loss="continue"``: the dedicated servers go on with the trainers that survive a
loss (:mod:`lightning_dp.comm.servers.regroup`)."""

from __future__ import annotations

import json
import pickle
import secrets
import subprocess
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dp._lightning_compat import after_closure, replace_clipping, trainer_of, unwrap_optimizer
from lightning_dp.comm.buckets import BucketReducer, GradientBucket
from lightning_dp.comm.cluster.peers import is_transport_error
from lightning_dp.comm.errors import ConfigurationError, PeerUnreachableError
from lightning_dp.comm.membership.fence import Connection
from lightning_dp.comm.servers import Control, MemberGroup, ServerPlan, member_shares
from lightning_dp.comm.servers.launch import start_local_server
from lightning_dp.comm.servers.regroup import (
    LOST,
    SERVING,
    Regroup,
    ServerWatch,
    listener_key,
    replica_holders,
    replicas_to_make,
    returning_address,
    serving_after,
    serving_back,
    state_key,
    tell_server,
    union_segments,
)
from lightning_dp.comm.servers.replicas import ReplicaLostError
from lightning_dp.comm.servers.sharded_optimizer import Segment, hyperparameters
from lightning_dp.comm.servers.transport import RegroupingServerTransport
from lightning_dp.comm.transports.shards import sum_everywhere
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.engines.dedicated import DedicatedEngine, follow_run_key
from lightning_dp.strategies.rank_loss import PULL

#: seconds the leader waits for a server to take a regroup message
TELL_SECONDS = 10.0
#: regroups in one step that lose nothing before the failure behind them is taken for what it is
MAX_EMPTY_REGROUPS = 3

#: the leader's finding at a regroup: the servers serving, their shares, the shares handed back, and the listener of
#: each server that returns with the seconds since it claimed its place
_Found = tuple[
    tuple[int, ...], dict[int, tuple[int, ...]], list[tuple[int, int, int]], dict[int, tuple[tuple[str, int], float]]
]


class RegroupingDedicatedEngine(DedicatedEngine):
    """:class:`DedicatedEngine` whose servers go on with the trainers that survive a loss. The servers hold every
    share (the trainers none: a trainer's loss takes no state), and never update in backward.

    A step's sync points (see :mod:`lightning_dp.strategies.rank_loss`): the exchange (every trainer's push; complete
    once every server replied that it summed them, sealed by one value round among the trainers), the vote (every
    server sends every trainer its shares' squared norm and NaN/inf flag; a collective), and the pull (the leader
    asks the servers to step, once per step whatever number of times it asks, and every trainer receives the new
    weights; sealed by one value round). After a loss the trainers' leader tells every server how the run goes on
    and the member group forms again over the survivors; a point no survivor completed runs again (the exchange over
    the survivors' gradients, reweighed), one that some completed travels to the others."""

    def __init__(self, strategy: DataParallelStrategy, num_servers: int, start_servers: bool) -> None:
        super().__init__(strategy, num_servers, start_servers, trainers_serve=False)
        #: regroups since the last step completed that lost nothing (a wait on a server that fails again and again)
        self._empty_regroups = 0
        #: each server's address for regroup messages, and the run's token they check
        self.listeners: list[tuple[str, int]] = []
        self.token = ""
        self._connections: list[Connection] = []
        self._old_members: list[MemberGroup] = []
        #: the servers serving now (their indices at set-up), in member order, and which shares each serves
        self.servers: tuple[int, ...] = ()
        self.serves: dict[int, tuple[int, ...]] = {}
        #: ``[b][s]``: server ``s``'s range of bucket ``b`` at set-up
        self.server_segments: list[list[Segment]] = []
        #: shares whose replica the servers were told to make again, until every server answered a request after it
        #: (a point another trainer completed before the regroup, taken from it, does not count)
        self._unreplicated: set[int] = set()
        #: the leader's probe of the servers, which finds a silent one (started once the servers joined)
        self.watch: ServerWatch | None = None
        self._server_failed_at: float | None = None
        #: the run's store (where a process started again for a lost server claims its place), on every trainer
        self._run_store: dist.Store | None = None
        #: the leader: lost servers a process was started again for, by server: its listener and when it was seen;
        #: those the leader asked the trainers to let in (at a step boundary)
        self._returning: dict[int, tuple[tuple[str, int], float]] = {}
        self._requested: set[int] = set()
        #: trainer 0: how many more times it starts a local server that died again (``restart_lost_servers``), and
        #: the processes replaced (reaped at the end)
        self._restarts_left = 0
        self._replaced: list[subprocess.Popen] = []
        #: servers whose process trainer 0 started again (until lost again), and claimants the leader found dead
        self._restarted: set[int] = set()
        self._claims_dead: list[int] = []
        #: ``(share, from, to)`` handed back to servers that returned, until every server answered a request after it
        self._handed: list[tuple[int, int, int]] = []

    _transport_type = RegroupingServerTransport

    # ------------------------------------------------------------------ set-up
    def check_devices(self, devices: list[torch.device]) -> None:
        if any(device.type != "cpu" for device in devices):
            raise ConfigurationError(
                f"strategy {self.name!r}: on_rank_loss='continue' with num_servers={self.num_servers} runs the "
                f"trainers on CPU devices only for now; got devices {[str(d) for d in devices]}"
            )

    def full_gradients(self, trainer: Any, readers: list[str]) -> bool:
        if super().full_gradients(trainer, readers):
            raise ConfigurationError(
                f"strategy {self.name!r}: on_rank_loss='continue' with num_servers={self.num_servers} cannot send the "
                f"averaged gradients back to the trainers, which {', '.join(readers) or 'another rank'} read before "
                "the optimizer step: declare reads_gradients = False on callbacks that do not need them, or use "
                "num_servers=0"
            )
        return False

    @property
    def member_rank(self) -> int:
        members = self.strategy.rank_loss.members
        return members.index(self.strategy.global_rank) if members else self.strategy.global_rank

    def setup_gradient_sync(self) -> None:
        if self.strategy.rank_loss.newcomer:
            self._set_up_newcomer()
            return
        members = self.strategy.rank_loss.members
        if members is not None and 0 not in members:
            raise ConfigurationError(
                f"strategy {self.name!r}: a fit with num_servers={self.num_servers} needs global rank 0, lost "
                "earlier in this job: the servers meet the trainers on the store it serves"
            )
        self._empty_regroups = 0
        self._old_members = []
        self._restarts_left = int(getattr(self.strategy, "restart_lost_servers", 0))
        self._restarted, self._claims_dead = set(), []
        super().setup_gradient_sync()
        rank_zero_info(
            f"{self.name}: on_rank_loss='continue': the {self.num_servers} dedicated servers hold every share and "
            "update after the step's vote; they go on with the trainers that survive a loss"
        )

    def _set_up_newcomer(self) -> None:
        """A new trainer in a lost one's place: its buckets only. The servers, their shares and the run's token come
        from the members' leader at its admission (:meth:`rebuild_exchange`), where it meets the servers; it starts
        none and sends them nothing (they hold the run's state)."""
        strategy = self.strategy
        if strategy.global_rank == 0:
            raise ConfigurationError(
                f"strategy {self.name!r}: a new process in global rank 0's place does not join a job with "
                f"num_servers={self.num_servers} (the servers meet the trainers on the store rank 0 served); a new "
                "process in another trainer's place does"
            )
        self.processes, self.transport, self.layout, self.optimizers = [], None, None, []
        self.closed, self.stopped, self.final_states = False, False, None
        self.expected_exits, self.local_servers, self.eager, self._static_clip = set(), None, False, None
        strategy.reducer = reducer = strategy.new_reducer()
        self._empty_regroups, self._old_members, self._restarts_left = 0, [], 0
        self._restarted, self._claims_dead = set(), []
        self._run_store, self._returning, self._requested, self._handed = None, {}, set(), []
        hooks = cast("Any", strategy.rank_loss).boundary_hooks
        if self._let_returning_in not in hooks:
            hooks.append(self._let_returning_in)
        strategy.mark_synchronized(reducer.params)
        strategy.sync_stats.bucket_bytes = sum(b.nbytes for b in reducer.buckets)
        self._restore_clipping = replace_clipping(strategy.precision_plugin, self._clip_request("norm"),
                                                  self._clip_request("value"))  # fmt: skip

    def _known(self) -> dict[str, Any]:
        """The leader: what a new trainer takes from it to meet the servers (as every member knows it now)."""
        assert self.transport is not None
        return {"token": self.token, "listeners": list(self.listeners), "servers": self.servers,
                "serves": self.serves, "server_segments": self.server_segments, "whole": self.whole,
                "message_bytes": self.transport.members.message_bytes, "unreplicated": set(self._unreplicated),
                "handed": list(self._handed), "run_key": self.run_key}  # fmt: skip

    def _take_known(self, known: dict[str, Any]) -> None:
        """A new trainer, admitted: the servers as the leader knows them (see :meth:`_known`)."""
        self.token, self.listeners, self.servers, self.serves = (known["token"], known["listeners"],
                                                                 known["servers"], known["serves"])  # fmt: skip
        self.server_segments, self.whole = known["server_segments"], known["whole"]
        self._unreplicated, self._handed = known["unreplicated"], known["handed"]
        self.run_key = known["run_key"]
        follow_run_key(self.strategy.job_scope, self.run_key)
        self._stop_watch()  # (one watch per trainer)
        heartbeat = float(cast("Any", self.strategy.rank_loss).heartbeat_timeout)
        self.watch = ServerWatch(self.listeners, self.token, heartbeat / 4, heartbeat, self._watched, self._silent,
                                 self._look_for_returning)  # fmt: skip

    def after_admission(self, joined: list[int]) -> bool:
        return True  # the servers hold every optimizer state, the trainers none: the handover sends hyperparameters

    def _eager_possible(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        self._static_clip = None
        return False

    def _plan(self, reducer: BucketReducer, optimizers: list[torch.optim.Optimizer]) -> ServerPlan:
        plan = super()._plan(reducer, optimizers)
        rank_loss: Any = self.strategy.rank_loss
        # the trainers recover at their next sync point, which a validation or a checkpoint may delay
        rejoin = max(self.strategy.timeout.total_seconds(), 6.0 * float(rank_loss.heartbeat_timeout))
        plan.extra["regroup"] = {"token": secrets.token_hex(16), "rejoin_timeout": rejoin}
        return plan

    def _join(self, store: dist.Store, num_trainers: int, num_servers: int) -> MemberGroup:
        membership = self.strategy.rank_loss.membership
        assert membership is not None
        members, self._connections = membership.form_apart(
            lambda: super(RegroupingDedicatedEngine, self)._join(store, num_trainers, num_servers),
            "the member group with the servers",
        )
        return members

    def _joined(self, store: dist.Store) -> None:
        plan = pickle.loads(store.get("plan"))  # noqa: S301 - written by trainer 0 of this run
        self.token = plan.extra["regroup"]["token"]
        assert self.transport is not None
        self.servers = tuple(range(self.num_servers))
        self.serves = {s: (s,) for s in self.servers}
        self._unreplicated = set()
        self.server_segments = [row[-self.num_servers :] for row in self.transport.segments]
        self.transport.members.on_failure = self._member_failed
        addresses = [json.loads(store.get(listener_key(i))) for i in range(self.num_servers)]
        self.listeners = [(str(host), int(port)) for host, port in addresses]
        self._run_store, self._returning, self._requested, self._handed = store, {}, set(), []
        hooks = cast("Any", self.strategy.rank_loss).boundary_hooks
        if self._let_returning_in not in hooks:
            hooks.append(self._let_returning_in)
        heartbeat = float(cast("Any", self.strategy.rank_loss).heartbeat_timeout)
        self.watch = ServerWatch(self.listeners, self.token, heartbeat / 4, heartbeat, self._watched, self._silent,
                                 self._look_for_returning)  # fmt: skip

    def _watched(self) -> tuple[int, ...]:
        """The servers the leader probes now: every one serving, until training ends."""
        membership = self.strategy.rank_loss.membership
        leads = membership is not None and membership.leader == self.strategy.global_rank
        return self.servers if leads and not (self.closed or self.stopped) else ()

    def _look_for_returning(self) -> None:
        """The leader (on the watch's thread): the processes started again for lost servers that claimed their place
        (let in at the next step boundary, :meth:`_let_returning_in`)."""
        membership, store = self.strategy.rank_loss.membership, self._run_store
        if membership is None or store is None or self.closed or self.stopped:
            return
        if membership.leader != self.strategy.global_rank or 0 not in membership.members:
            return  # (not the leader, or the store went with global rank 0)
        for server in range(self.num_servers):
            if server in self.servers or server in self._returning:
                continue
            try:
                address = returning_address(store, server)
            except Exception:  # noqa: BLE001 - the store went with global rank 0: nobody can claim a place
                return
            if address is not None:
                self._returning[server] = (address, time.monotonic())

    def _let_returning_in(self) -> None:
        """The leader, at a step boundary (a sync point follows): a change that loses no trainer for the servers
        started again since the last one, at whose regroup they serve again."""
        membership = self.strategy.rank_loss.membership
        waiting = sorted(set(self._returning) - self._requested)
        if membership is None or not waiting or self._handed or self.closed or self.stopped:
            return  # (an earlier return not confirmed yet: it would be held back, a change for nothing)
        self._requested.update(waiting)
        membership.request_change(f"a process was started again for dedicated server(s) {waiting}")

    def _restart(self, lost: list[int]) -> None:
        """Trainer 0 (``restart_lost_servers``): start the lost servers it started again, with the same command; each
        claims its place once marked lost (:meth:`_mark`) and is let in at a step boundary."""
        if self.local_servers is None:
            return
        for server in lost:
            if self._restarts_left <= 0 or server >= len(self.processes):
                continue
            self._restarts_left -= 1
            self.processes[server].kill()  # (one taken for lost while stopped never comes back)
            self._replaced.append(self.processes[server])
            self.processes[server] = start_local_server(server, *self.local_servers)
            self._restarted.add(server)  # (expected to exit cleanly once it serves again)
            rank_zero_info(f"strategy {self.name!r}: dedicated server {server} started again "
                           f"(restart_lost_servers: {self._restarts_left} left)")  # fmt: skip

    def _mark(self, servers: list[int], state: str) -> None:
        """The leader: record ``servers``' state in the run's store (:data:`LOST`: a process started again for one
        may join)."""
        store, membership = self._run_store, self.strategy.rank_loss.membership
        if store is None or self.member_rank != 0 or membership is None or 0 not in membership.members:
            return  # (not the leader, or the store went with global rank 0)
        for server in servers:
            try:
                store.set(state_key(server), state)
            except Exception:  # noqa: BLE001 - the store went with global rank 0: no process can join any more
                return

    def _silent(self, server: int, why: str) -> None:
        """A server did not answer the leader's probe: a change that loses no trainer, as for a server that failed."""
        membership = self.strategy.rank_loss.membership
        if membership is None or self.closed or self.stopped:
            return
        if self._server_failed_at is None:
            self._server_failed_at = time.monotonic()
        membership.request_change(f"dedicated server {server} {why}")

    def send_weights(self, buckets: list[GradientBucket]) -> None:
        super().send_weights(buckets)
        transport = self.transport
        assert isinstance(transport, RegroupingServerTransport)
        if self.is_trainer_zero:  # (a server lost before its replica took them ends the run here, not silently later)
            transport.wait_weights_taken()

    def exchange_weights(self) -> None:
        """A timed synchronization's pull (its gradients are nobody's step), once every server replied that it
        summed them."""
        transport = self.transport
        assert isinstance(transport, RegroupingServerTransport)
        if transport.unacknowledged:
            transport.wait_summed()
        super().exchange_weights()

    # ------------------------------------------------------------------ the step
    def seal_exchange(self) -> None:
        transport = self.transport
        assert isinstance(transport, RegroupingServerTransport)
        transport.wait_summed()
        self._unreplicated = set()  # every server replied: each made the replicas it was to make before serving
        self._handed = []  # (and each server that returned received its shares)
        sum_everywhere(torch.zeros(1), self.strategy.gradient_group)

    @property
    def exchange_outcome_travels(self) -> bool:
        return False  # every server holds the step's sums wherever any trainer completed the exchange

    def point_completed(self, kind: str) -> None:
        if kind == PULL:
            self._empty_regroups = 0

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        strategy = self.strategy
        assert self.transport is not None and strategy.reducer is not None
        index = self._optimizer_index(optimizer)
        result = closure()
        strategy.reducer.consume()
        self._clip = None
        after_closure(strategy.precision_plugin, model, optimizer)  # on_before_optimizer_step hooks, clipping
        squares, bad = strategy.rank_loss.collective(strategy, lambda group: self._vote(index, group))
        if bad:
            strategy.raise_nonfinite(None)
        # the step's key: the exchanges this fit committed, the same on every trainer (each counts its own)
        key = cast("Any", strategy.rank_loss).committed
        control = {"hyperparameters": [hyperparameters(g) for g in optimizer.param_groups], "clip": self._clip,
                   "squares": squares, "kwargs": kwargs, "key": key}  # fmt: skip
        buckets = strategy.buckets_of(optimizer)
        start = time.perf_counter()

        def pull() -> None:
            transport = self.transport
            assert transport is not None
            if transport.me == 0:
                transport.control(Control.STEP, index, control)
            for bucket in buckets:
                bucket.pack_params(*transport.owned(bucket))
            transport.share_weights_all(buckets)
            self._unreplicated, self._handed = set(), []  # (as after the exchange: every server answered)
            for bucket in buckets:
                bucket.unpack_params()
            sum_everywhere(torch.zeros(1), strategy.gradient_group)

        strategy.rank_loss.weight_pull(strategy, pull)
        strategy.end_step(blocking_seconds=time.perf_counter() - start)
        return result

    def _vote(self, index: int, group: dist.ProcessGroup | None) -> tuple[float, bool]:
        transport = self.transport
        assert isinstance(transport, RegroupingServerTransport)
        verdict = transport.vote_of(index)
        sum_everywhere(torch.zeros(1), group)  # no trainer completes the vote before every trainer has it
        return verdict

    # ------------------------------------------------------------------ a loss
    def _member_failed(self, member: int, error: BaseException) -> None:
        """A wait with ``member`` of the member group failed: a server's starts a change that loses no trainer (every
        trainer stops exchanging and the leader finds out which servers are gone); a trainer's is the membership's."""
        transport, membership = self.transport, self.strategy.rank_loss.membership
        if transport is None or membership is None or member < transport.members.num_trainers:
            return
        if not (isinstance(error, PeerUnreachableError) or is_transport_error(error)):  # a local error is no loss
            return
        if self._server_failed_at is None:
            self._server_failed_at = time.monotonic()
        place = member - transport.members.num_trainers
        server = self.servers[place] if place < len(self.servers) else place
        # (the server may be lost, or have fenced its member group for another member's loss: the leader probes it)
        membership.request_change(f"the exchange with dedicated server {server} failed ({type(error).__name__})")

    def rebuild_exchange(self) -> None:
        """The groups over the trainers that train now; the leader finds the servers that are there (a lost one's
        shares move to their replicas' holder, and the shares left without a replica get one again), tells each how
        the run goes on, and the member group forms again (collective over the trainers and those servers)."""
        strategy = self.strategy
        strategy.rebuild_groups()
        old = self.transport
        if self.closed or self.stopped or strategy.reducer is None:
            return
        assert old is None or isinstance(old, RegroupingServerTransport)
        membership = strategy.rank_loss.membership
        assert membership is not None
        n, me = membership.size, self.member_rank
        if old is None and me == 0:  # (the members see it go, and go on without it)
            raise ConfigurationError(
                f"strategy {self.name!r}: a new trainer below every member's rank would lead the trainers before it "
                "knows the servers; start it in the place of a rank above the lowest member's"
            )
        known = self._known() if me == 0 else None
        outcome: list[Any] = [self._find_servers() if me == 0 else None, known]
        dist.broadcast_object_list(outcome, group=strategy.gradient_group, group_src=0)
        if old is None:  # a new trainer, admitted
            self._take_known(outcome[1])
        if me == 0:
            dead, self._claims_dead = self._claims_dead, []
            self._restart(dead)
        if isinstance(outcome[0], str):
            raise ReplicaLostError(outcome[0])
        servers, serves, handed, returning = outcome[0]
        received = time.monotonic()
        for server, (address, _) in returning.items():  # (every trainer: a later leader probes them there)
            self.listeners[server] = address
        lost = [s for s in self.servers if s not in servers]
        returned = [s for s in servers if s not in self.servers]
        before = self.serves
        prefix = f"{self.token}/gen{membership.generation}"
        if me == 0:
            message = Regroup(membership.generation, n, servers, tuple(serves[s] for s in servers),
                              membership.store_address, prefix, self.token, tuple(handed))  # fmt: skip
            for server in servers:
                address = self.listeners[server]
                try:
                    tell_server(address, message, TELL_SECONDS)
                except OSError as error:  # lost since the probe: the trainers agree again, and the probe finds it
                    membership.request_change(f"dedicated server {server} did not take the regroup message")
                    raise PeerUnreachableError(
                        f"strategy {self.name!r}: dedicated server {server} (at {address[0]}:{address[1]}) cannot be "
                        f"reached any more: {error}"
                    ) from error
        message_bytes, timeout, k = outcome[1]["message_bytes"], strategy.timeout, len(servers)

        def create() -> MemberGroup:
            store = dist.TCPStore(*membership.store_address, is_master=False, timeout=timeout)
            return MemberGroup(dist.PrefixStore(prefix, store), me, n, k, timeout, message_bytes=message_bytes)

        members, self._connections = membership.form_apart(create, "the member group with the servers")
        members.on_failure = self._member_failed
        if old is not None:
            self._old_members.append(old.members)  # (fenced; closed with the process: a peer may still be in it)
        segments = [[(0, 0)] * n + row for row in union_segments(self.server_segments, [serves[s] for s in servers])]
        transport = RegroupingServerTransport(members, member_shares(n, k, trainers_serve=False), self.whole,
                                              strategy.gradient_group, strategy.sync_stats, timeout,
                                              segments=segments)  # fmt: skip
        transport.bind(strategy.reducer.buckets)
        self.transport = strategy.transport = transport
        if old is None:
            self._shard_optimizers()
        made = replicas_to_make(before, serves, handed)
        self._unreplicated |= {share for shares in made.values() for share in shares}
        self._handed = list(handed)
        holders = replica_holders(sorted(before))
        self.servers, self.serves = servers, serves
        self._mark(lost, LOST)
        self._mark(returned, SERVING)
        if returned:
            waited = {s: age + time.monotonic() - received for s, (_, age) in returning.items()}
            self._report_returned(returned, handed, made, waited)
        if lost:
            began = [t for t in (self._server_failed_at, membership.change_began) if t is not None]
            seconds = time.monotonic() - min(began) if began else 0.0
            self.expected_exits.update(lost)
            self._restarted.difference_update(lost)
            self._restart(lost)
            rank_loss: Any = strategy.rank_loss
            rank_loss.lost_servers += lost
            rank_loss.server_recovery_seconds += [seconds] * len(lost)
            moved = "; ".join(f"server {s}'s shares {list(before[s])} to server {holders[s]}, which held their "
                              "replicas" for s in lost)  # fmt: skip
            again = "; ".join(f"shares {list(shares)} on server {s}" for s, shares in sorted(made.items()))
            replicas = f"replicas made again of {again}" if made else "no replica left: a further loss ends the run"
            rank_zero_warn(f"strategy {self.name!r}: lost dedicated server(s) {lost}; {moved} (recovered in "
                           f"{seconds:.2f} s); {replicas}")  # fmt: skip
        self._server_failed_at = None
        changed = [loss.generation for loss in membership.losses] + [leave.generation for leave in membership.leaves]
        changed += [join.generation for join in membership.joins]
        if not lost and not returned and membership.generation not in changed:  # (no rank lost, left or joined)
            self._empty_regroups += 1  # nothing was lost: the wait that failed is run again
            if self._empty_regroups > MAX_EMPTY_REGROUPS:
                raise RuntimeError(
                    f"strategy {self.name!r}: the trainers' exchanges with the dedicated servers failed "
                    f"{self._empty_regroups} times in one step although every trainer and server answers: the "
                    "failure is not a lost peer (see the errors logged before)"
                )

    def _find_servers(self) -> _Found | str:
        """The leader: the servers that answer a probe, which shares each serves from now on (a lost server's share
        moves to its replica's holder; a server started again takes its own back, :func:`serving_back`), the shares
        handed back ``(share, from, to)`` (those of an earlier regroup that no server answered after included) and
        the listeners of the servers that return; or why that cannot be."""
        alive = []
        silent = self.watch.silent if self.watch is not None else set()
        timeout = float(cast("Any", self.strategy.rank_loss).heartbeat_timeout)
        for server in self.servers:
            if server in silent:  # (its probe timed out already)
                continue
            try:
                tell_server(self.listeners[server], None, timeout, token=self.token)
                alive.append(server)
            except OSError:
                continue
        lost = set(self.servers) - set(alive)
        gone = sorted({share for share, giver, _ in self._handed if giver in lost})
        if gone:  # (whether the server it handed them to holds them is not known)
            return (f"dedicated server(s) {sorted(lost)} lost while handing shares {gone} back to a server started "
                    "again, which may not hold them yet: restart the run from its last checkpoint")  # fmt: skip
        try:
            serves = serving_after(self.serves, lost, self._unreplicated)
        except ReplicaLostError as error:
            return str(error)
        handed = [(share, giver, taker) for share, giver, taker in self._handed
                  if giver in serves and share in serves.get(taker, ())]  # fmt: skip
        # one server started again per regroup, asked for at a step boundary, and none in a regroup that loses one or
        # while an earlier one has not confirmed holding its shares: each takes its shares back from a server that
        # holds them (the next one waits for the next step boundary)
        returning: dict[int, tuple[tuple[str, int], float]] = {}
        for server, (address, claimed) in sorted(self._returning.items()):
            if lost or returning or handed or server not in self._requested:
                self._requested.discard(server)
                continue
            try:
                tell_server(address, None, timeout, token=self.token)
                returning[server] = (address, time.monotonic() - claimed)
            except OSError:  # gone before it was let in: another process may claim the place
                self._mark([server], LOST)
                del self._returning[server]
                self._requested.discard(server)
                self._claims_dead.append(server)  # (started again once every trainer has the outcome)
        for server in returning:
            serves, giver = serving_back(serves, server)
            handed += [(share, giver, server) for share in serves[server]]
        if returning:
            silent.difference_update(returning)
        return tuple(sorted(serves)), serves, handed, returning

    def _report_returned(
        self,
        returned: list[int],
        handed: list[tuple[int, int, int]],
        made: dict[int, tuple[int, ...]],
        waited: dict[int, float],
    ) -> None:
        """Count and say which servers serve again, and how long each took from its claim (``waited``)."""
        rank_loss: Any = self.strategy.rank_loss
        # a process trainer 0 started again serves now (not one started elsewhere that claimed the place first): it
        # stops when the fit ends, as the others, and its exit code counts
        self.expected_exits.difference_update(
            s for s in set(returned) & self._restarted if s < len(self.processes) and self.processes[s].poll() is None
        )
        for server in returned:
            self._returning.pop(server, None)
            self._requested.discard(server)
            rank_loss.returned_servers.append(server)
            rank_loss.server_return_seconds.append(waited.get(server, 0.0))
            trainer = trainer_of(self.strategy.lightning_module)
            rank_loss.server_return_steps.append(int(trainer.global_step) if trainer is not None else -1)
        back = "; ".join(f"server {s} takes back shares {[h for h, _, t in handed if t == s]} from server "
                         f"{next(g for _, g, t in handed if t == s)}" for s in returned)  # fmt: skip
        again = "; ".join(f"shares {list(shares)} on server {s}" for s, shares in sorted(made.items()))
        rank_zero_warn(f"strategy {self.name!r}: dedicated server(s) {returned} started again and serve again: {back}"
                       + (f"; replicas made again of {again}" if made else ""))  # fmt: skip

    # ------------------------------------------------------------------ checkpoints and the end
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The full optimizer state on the leader, from every server's share (the trainers hold none)."""
        if self.closed or self.stopped or self.strategy.lightning_module is None:
            return super().optimizer_state(optimizer)
        if self.strategy.lightning_module.trainer.state.status == TrainerStatus.INTERRUPTED:
            return super().optimizer_state(optimizer)
        assert self.transport is not None
        if self.transport.me != 0:
            return {}
        index = [unwrap_optimizer(o) for o in self.strategy.optimizers].index(optimizer)
        sharded = self.optimizers[index]
        sharded.merge_states(self.transport.server_states(index))
        return sharded.state_dict()

    def on_train_end(self) -> None:
        if self.closed:
            return
        strategy = self.strategy
        assert self.transport is not None
        leader = self.transport.me == 0
        states = [self.optimizer_state(unwrap_optimizer(o)) for o in strategy.optimizers] if leader else None
        self._stop_watch()  # (a server that stops is not silent)
        if leader:
            self.transport.stop_servers()
        self.stopped = True

        def share(group: dist.ProcessGroup | None) -> list[dict] | None:
            # every trainer keeps the final states (a later checkpoint may be written by another leader), from the
            # lowest member that has them (none, where the leader was lost with them: optimizer_state then says so)
            container: list[Any] = [states]
            dist.broadcast_object_list(container, group=group, group_src=0)
            dist.barrier(group=group)
            return cast("list[dict] | None", container[0])

        self.final_states = strategy.rank_loss.collective(strategy, share)

    def on_exception(self, exception: BaseException) -> None:
        """The servers go on with the other trainers (this one leaves as a lost rank would); local servers, children
        of this process, end with it, at once (nobody tells them to stop)."""
        self._stop_watch()
        for process in self.processes:
            process.kill()
        self.close(stop=False)

    def _stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def close(self, stop: bool = True) -> None:
        self._stop_watch()
        for process in self._replaced:  # (killed when they were replaced)
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        self._replaced = []
        hooks = cast("Any", self.strategy.rank_loss).boundary_hooks
        if self._let_returning_in in hooks:
            hooks.remove(self._let_returning_in)
        for server in self.expected_exits:  # lost: a local one stopped or cut off would only hold up the end
            if server < len(self.processes):
                self.processes[server].kill()
        membership = self.strategy.rank_loss.membership
        if membership is not None and self._connections:
            membership.release(self._connections)
        self._connections = []
        super().close(stop)
