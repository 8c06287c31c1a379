"""Processes, ranks and process groups for every lightning-dp strategy: what it shares with Lightning's ``ddp``.

:class:`ProcessGroupStrategy` is a :class:`~lightning.pytorch.strategies.DDPStrategy` (so Lightning's
compiled-model check and user code that tests ``isinstance(strategy, DDPStrategy)`` accept it) that launches the
ranks, joins the process group with sockets bound to one interface, creates a second group for gradient
traffic, and names the lost peer when one of Lightning's collectives fails. It knows nothing of gradients.
"""

from __future__ import annotations

import atexit
import os
import subprocess
from datetime import timedelta
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_dp._lightning_compat import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
    trainer_of,
)
from lightning_dp.comm.cluster.peers import PeerDirectory, naming_lost_peer
from lightning_dp.comm.cluster.rendezvous import (
    init_bound_process_group,
    register_close_at_exit,
    this_launch,
)
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.transports.shm import NodeLayout
from lightning_dp.strategies.launchers import (
    EXIT_GRACE_SECONDS,
    ProcessLauncher,
    ScriptLauncher,
    die_with_launcher,
    wait_for_exit,
)
from lightning_dp.strategies.options import check_backend_for_devices, check_choice, check_count, check_timeout
from lightning_dp.strategies.rank_loss import DEFAULT_HEARTBEAT_SECONDS, StopOnRankLoss, make_rank_loss
from lightning_dp.strategies.resume import resume_mid_epoch, stop_silencing

START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("gloo", "nccl")
#: how long a rank waits for a peer by default: long enough for a slow checkpoint write on rank 0, short enough
#: that a dead peer or a cut link ends the run within minutes
DEFAULT_TIMEOUT = timedelta(minutes=5)


class ProcessGroupStrategy(DDPStrategy):
    """Launching, ranks, devices, the process groups and Lightning's collectives (see the module docstring).

    Args:
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default NCCL on CUDA devices and gloo otherwise. NCCL
            needs CUDA devices (refused otherwise when the Trainer is built); gloo runs on CUDA devices too, its
            buckets staged through pinned host memory, and lets several ranks share one GPU, which NCCL refuses.
        timeout: how long any collective or message may wait for a peer (``timedelta`` or seconds, default 5
            minutes) before the run fails with an error instead of hanging. Raise it when nodes start minutes
            apart or one rank works alone for long while the others wait (a long ``prepare_data`` download on
            local rank 0, an evaluation only rank 0 runs).
        start_method: how the extra processes are started: ``"popen"`` (re-run the script, like ``ddp``),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        on_rank_loss: what the job does when a training rank is lost (its process dies, its host is cut off):
            ``"stop"`` (default): every rank stops with an error naming it; ``"continue"``: the survivors agree on
            the new membership and go on without a restart (:mod:`~lightning_dp.strategies.rank_loss`,
            ``docs/faults.md``).
        heartbeat_timeout: with ``on_rank_loss="continue"``, seconds without a heartbeat after which a silent rank
            is taken for lost (default 10); a process that dies is noticed at once.
        max_lost_ranks: with ``on_rank_loss="continue"``, how many ranks the job may lose in all before it stops
            (default: any number that leaves a strict majority of the ranks it started with).
        restart_lost_ranks: with ``on_rank_loss="continue"`` and Lightning's ``popen`` launcher, how many times in all
            the process that started a machine's ranks starts one that died again (the same command), to join the
            running job in its place (default 0: never). A process started by hand, by ``srun`` or by any launcher
            with the job's command and variables joins the same way.
        max_ranks: with ``on_rank_loss="continue"``, how many ranks the job may grow to (default: as many as it
            starts with): a process started with a rank past the starting ones (the job's command with a larger
            world size, as for a lost rank's replacement) joins the running job in that place.
    """

    strategy_name: ClassVar[str] = ""

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        on_rank_loss: Literal["stop", "continue"] = "stop",
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_SECONDS,
        max_lost_ranks: int | None = None,
        restart_lost_ranks: int = 0,
        max_ranks: int | None = None,
    ) -> None:
        check_choice("start_method", start_method, START_METHODS)
        #: the ``on_rank_loss`` mode, chosen once here
        self.rank_loss: StopOnRankLoss = make_rank_loss(on_rank_loss, heartbeat_timeout, max_lost_ranks, max_ranks)
        if self.rank_loss.name == "continue" and start_method != "popen":
            raise ConfigurationError(
                f"on_rank_loss='continue' needs start_method='popen' (got {start_method!r}): torch's multiprocessing "
                "launcher ends every process when one dies"
            )
        self.restart_lost_ranks = check_count("restart_lost_ranks", restart_lost_ranks, 0)
        if self.restart_lost_ranks and self.rank_loss.name != "continue":
            raise ConfigurationError(
                f"restart_lost_ranks={restart_lost_ranks} needs on_rank_loss='continue' (got {on_rank_loss!r}): a "
                "restarted rank joins a job that went on without it"
            )
        super().__init__(  # DDPStrategy's state for its inherited helpers; its DDP-wrapping paths are never taken
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            start_method=start_method,
        )
        if process_group_backend is not None:
            check_choice("process_group_backend", process_group_backend, BACKENDS)
        self._process_group_backend = process_group_backend
        self._timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
        self._start_method = start_method
        self._num_nodes = 1
        #: the process group that carries gradient and weight traffic (never interleaved with Lightning's)
        self.gradient_group: dist.ProcessGroup | None = None
        self._peers = PeerDirectory()
        #: which ranks share a machine, gathered from every rank's node rank once the groups exist
        self.node_layout: NodeLayout | None = None
        #: the prefix of every rendezvous key of this job (``None`` where another party created the default group)
        self.job_scope: str | None = None
        self._control_group: dist.ProcessGroup | None = None

    @property
    def timeout(self) -> timedelta:
        """How long a peer may stay silent before the run fails (the ``timeout`` option)."""
        assert self._timeout is not None
        return self._timeout

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        """This rank's device: one per local rank, or the single device a launcher that starts every rank itself
        gave it (Ray Train, torchrun with ``devices="auto"``: each process sees one device)."""
        devices = self.parallel_devices
        assert devices is not None
        if self.local_rank < len(devices):
            return devices[self.local_rank]
        if len(devices) == 1:
            return devices[0]
        raise ConfigurationError(
            f"strategy {self.strategy_name!r}: local rank {self.local_rank} has no device among the {len(devices)} "
            f"given ({devices}); set `devices` to the number of processes per node, or to 'auto' where the cluster "
            "starts the processes (each then uses the one device it sees)"
        )

    @property
    @override
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The epoch's order is that of every rank the job started with (a rank's loss re-deals the global batch
        among the survivors, it does not change the order)."""
        started = self.rank_loss.started
        replicas = len(started) if started is not None else self.world_size
        # (a rank the job grew by has no place among them: the balanced sampler deals its training batches, and the
        # members' sampler its evaluation's)
        return {"num_replicas": replicas, "rank": min(self.global_rank, replicas - 1)}

    @property
    def ranks_on_this_node(self) -> int:
        """How many ranks share this rank's machine (known once the process groups exist)."""
        return self.node_layout.local_size if self.node_layout is not None else self.num_processes

    @property
    def single_node(self) -> bool:
        """Whether every rank runs on one machine (known once the process groups exist)."""
        return self.node_layout.num_nodes == 1 if self.node_layout is not None else self.num_nodes == 1

    def _launched_externally(self) -> bool:
        """Whether a cluster (torchrun, SLURM, Ray, MPI) starts the ranks and names their ranks and world size (not
        Lightning's own launcher, whose environment also says so in the ranks it started: those hold its launch)."""
        env = self.cluster_environment
        return env is not None and env.creates_processes_externally and this_launch() is None

    def _single_host(self) -> bool:
        """Whether every rank runs on this machine, as far as the launcher says before the groups exist."""
        if not self._launched_externally():
            return self.num_nodes == 1
        for nodes in ("GROUP_WORLD_SIZE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):  # torchrun's, SLURM's node count
            if os.environ.get(nodes, "").isdigit():
                return int(os.environ[nodes]) == 1
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        assert self.cluster_environment is not None
        return local.isdigit() and int(local) == self.cluster_environment.world_size()

    @property
    @override
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        # called in every process once the world size is known: check options that depend on it now
        env = self.cluster_environment
        assert env is not None
        check_backend_for_devices(self._process_group_backend, self.parallel_devices or [])
        if self._launched_externally():
            # the cluster's rules as `ddp` applies them (SLURM: --ntasks-per-node must equal devices, torchrun:
            # devices x num_nodes the world size), unless one device is given (each rank then uses it: Ray's
            # workers with devices="auto", CPU ranks)
            if self.num_processes > 1:
                env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            self._check_world_size(env.world_size())
            return
        self._check_world_size(self.num_nodes * self.num_processes)
        if self._start_method == "popen":
            self._launcher = ScriptLauncher(env, self.num_processes, self.num_nodes)
            self._launcher.survives_rank_loss = self.rank_loss.name == "continue"
            self._launcher.restarts = self.restart_lost_ranks
        else:
            self._launcher = ProcessLauncher(self, start_method=self._start_method)

    @property
    def max_ranks(self) -> int | None:
        """How many ranks the job may grow to (``None``: as many as it starts with)."""
        return getattr(self.rank_loss, "max_ranks", None)

    def _check_world_size(self, world_size: int) -> None:
        """Validate options against the number of processes (subclasses add theirs)."""
        if world_size and self.max_ranks is not None and self.max_ranks < world_size:
            raise ConfigurationError(
                f"strategy {self.strategy_name!r}: max_ranks={self.max_ranks} is below the {world_size} ranks the job "
                "starts with; it is how many ranks the job may grow to (None: as many as it starts with)"
            )

    @override
    def set_world_ranks(self) -> None:
        """Ranks and world size from ``devices`` and ``num_nodes``, as ``ddp``; the environments of clusters that
        start the ranks themselves ignore them and report their own (so ``devices="auto"`` works there)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        # the accelerator first (it selects the CUDA device NCCL binds to), then the process groups; DDPStrategy's
        # own version would join them before the device is set
        die_with_launcher()
        self._wait_for_started_ranks()
        ParallelStrategy.setup_environment(self)
        self.setup_distributed()

    def _wait_for_started_ranks(self) -> None:
        """In the process that started the node's other ranks (``popen``): before it exits, wait (up to the timeout)
        for them to finish, since they die with it (what a rank does after ``fit``, e.g. writing its results, must
        not be cut short by rank 0 finishing first)."""
        launcher = self._launcher
        if not any(isinstance(p, subprocess.Popen) for p in getattr(launcher, "procs", [])) or self.local_rank != 0:
            return
        assert self._timeout is not None
        # those still running after it are ended by the parent-death signal as this process exits; this process's
        # groups (and the store it serves them) close after they have gone. (The launcher's list at exit: a rank
        # started again in a lost one's place is waited for too.)
        register_close_at_exit()
        atexit.register(lambda: wait_for_exit(list(getattr(launcher, "procs", [])), self.timeout.total_seconds()))

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failing launcher stops the ranks it started within seconds (instead of leaving them waiting for it):
        they get :data:`EXIT_GRACE_SECONDS` to fail on their own and report why (a peer's error is often the same
        one), then they are killed."""
        if isinstance(self._launcher, ScriptLauncher):  # the ranks ending now are not restarted
            self._launcher.stop_restarting()
        super().on_exception(exception)
        self.rank_loss.on_exception()
        processes = getattr(self._launcher, "procs", [])
        wait_for_exit(processes, EXIT_GRACE_SECONDS)
        for process in processes:
            if process.poll() is None if isinstance(process, subprocess.Popen) else process.is_alive():
                process.kill()

    @override
    def setup_distributed(self) -> None:
        """Join the default process group (sockets on the configured interface only, see
        :mod:`lightning_dp.comm.cluster.rendezvous`), then create the group that carries gradient traffic."""
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        env = self.cluster_environment
        assert env is not None
        timeout = self._timeout
        assert timeout is not None  # set in __init__
        if not _distributed_is_initialized():
            scope = init_bound_process_group(
                self._process_group_backend, env.main_address, env.main_port, env.global_rank(), env.world_size(),
                timeout, single_host=self._single_host(), node_rank=self.node_rank, local_rank=self.local_rank,
            )  # fmt: skip
            _joined_default_group[:] = [(dist.group.WORLD, scope)]
            # after joining: torchrun's MASTER_ADDR/PORT must stay as the agent set them until then
            os.environ["MASTER_ADDR"] = env.main_address
            os.environ["MASTER_PORT"] = str(env.main_port)
        elif _own_scope() is None and not any(group is dist.group.WORLD for group in _external_groups_told):
            _external_groups_told.append(dist.group.WORLD)
            rank_zero_info(
                f"strategy {self.strategy_name!r}: the default process group was created before the strategy (e.g. by "
                "Ray Train): the option `timeout` applies to the strategy's gradient traffic only, and its sockets are "
                "not narrowed to the interface towards MASTER_ADDR; the default group keeps its creator's settings"
            )
        # a later fit or test in this process reuses the group and scope an earlier one joined
        self.job_scope = _own_scope()
        self.gradient_group, self._control_group = self.rank_loss.form_groups(self)
        # (the stage's first collectives: a rank lost since the last stage is noticed here, or in the next ones)
        if self._process_group_backend == "gloo":  # NCCL's errors carry no peer address to look up
            self._peers = self.rank_loss.setup_collective(self, PeerDirectory.build)

        def gather_layout(group: dist.ProcessGroup | None) -> None:
            # set here, not returned: a rank one point behind after a loss keeps the layout its recovery gathered
            self.node_layout = NodeLayout.gather(self.node_rank, group)

        self.rank_loss.setup_collective(self, gather_layout)
        self._check_world_size(self.world_size)

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The group of the collectives the training loop itself runs between exchanges (rank 0's buffers, the
        balancer's timings) and of Lightning's: the default group (``None``), or with ``on_rank_loss="continue"`` the
        membership's group over the ranks that train now; never :attr:`gradient_group`, so that they never
        interleave with an exchange the communication thread may be running there (the servers' pull behind the
        forward)."""
        return self._control_group

    @property
    @override
    def world_size(self) -> int:
        """How many ranks train now (fewer than started after a loss, with ``on_rank_loss="continue"``)."""
        members = self.rank_loss.members
        return len(members) if members is not None else super().world_size

    @property
    @override
    def is_global_zero(self) -> bool:
        """Whether this rank holds global rank 0's roles: rank 0, or after its loss the lowest rank training now."""
        members = self.rank_loss.members
        return members[0] == self.global_rank if members is not None else super().is_global_zero

    def source_rank(self, src: int) -> int:
        """Where a collective of Lightning's that names global rank ``src`` takes its value from: ``src``, or the
        lowest rank training now if ``src`` was lost."""
        members = self.rank_loss.members
        return src if members is None or src in members else members[0]

    @override
    def teardown(self) -> None:
        if isinstance(self._launcher, ScriptLauncher):  # a rank that dies once the fit ended stays down
            self._launcher.stop_restarting()
        super().teardown()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A new process joining a running job restores the state its members hand it once its set-up admitted it."""
        return self.rank_loss.restores_after_setup

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``checkpoint_path``, or in a new process joining a running job the state its members
        handed it (which wins over a checkpoint the command names: the job has moved on since)."""
        live = self.rank_loss.live_checkpoint()
        return live if live is not None else super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        stop_silencing()  # the loop has checked whether the resumed loader resumes by now
        super().on_train_batch_start(batch, batch_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A run resumed mid-epoch continues with the batches it had not trained yet (see :mod:`.resume`)."""
        module = self.lightning_module
        trainer = trainer_of(module)
        return resume_mid_epoch(trainer, dataloader) if trainer is not None else dataloader

    # ------------------------------------------------------------------ Lightning's collectives, naming lost peers
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        with naming_lost_peer("a barrier", directory=self._peers):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                self.rank_loss.collective(self, lambda group: dist.barrier(group=group))

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        with naming_lost_peer("Lightning's broadcast", directory=self._peers):
            return self.rank_loss.broadcast_object(self, obj, self.source_rank(src))

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Lightning's reduction of logged values and decisions, on :attr:`control_group` unless ``group`` is given."""
        if not isinstance(tensor, Tensor):
            return tensor
        what = "Lightning's reduce (sync_dist logging or a collective decision)"
        with naming_lost_peer(what, group, self._peers):
            if group is not None and group is not dist.group.WORLD:
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
            reducible = self.rank_loss.reducible
            return self.rank_loss.collective(
                self, lambda g: _sync_ddp_if_available(reducible(tensor), g, reduce_op=reduce_op)
            )

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        with naming_lost_peer("Lightning's all_gather", group, self._peers):
            if group is not None and group is not dist.group.WORLD:  # (LightningModule.all_gather names WORLD)
                return super().all_gather(tensor, group=group, sync_grads=sync_grads)
            gather = super().all_gather
            return self.rank_loss.collective(self, lambda g: gather(tensor, group=g, sync_grads=sync_grads))

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Each concrete strategy registers its own names (not DDPStrategy's ``ddp`` entries)."""

    @classmethod
    def _register_variants(cls, strategy_registry: Any, name: str, description: str) -> None:
        """Register ``name`` (popen, like ``ddp``) plus ``name_spawn`` and ``name_fork`` variants."""
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            strategy_registry.register(
                name + suffix,
                cls,
                description=f"{description} (start_method={start_method!r})",
                override=True,
                start_method=start_method,
            )


#: the default group this process joined itself, and its job scope (held, so that no later group reuses its id)
_joined_default_group: list[tuple[object, str]] = []


#: default groups another party created that a strategy has already said so about (once per group)
_external_groups_told: list[object] = []


def _own_scope() -> str | None:
    """The job scope of the current default group if this process joined it itself (``None``: another party did)."""
    return next((scope for group, scope in _joined_default_group if group is dist.group.WORLD), None)
