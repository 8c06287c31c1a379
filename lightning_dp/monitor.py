"""``CommMonitor``: what each optimizer step's synchronization moved and cost, beside what the cost model predicts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dp.comm.buckets import assign_buckets
from lightning_dp.comm.cluster.probe import measure_link
from lightning_dp.comm.cost import Link, Scheme, StepCost, Topology, Wire, core_sharing, rank_traffic, step_cost
from lightning_dp.comm.stats import SyncStats
from lightning_dp.strategies.base import DataParallelStrategy

#: the metrics logged per optimizer step, under the monitor's prefix
METRICS = ("bytes_sent", "bytes_received", "seconds", "exposed_seconds", "peer_wait_seconds", "bandwidth_MBps")


@dataclass
class CommSummary:
    """Means per optimizer step over a fit (this rank), and the prediction for the same step."""

    strategy: str
    steps: int = 0
    link: Link | None = None
    link_measured: bool = True
    #: whether the link's barrier, reduction rate and slowdown beside backward inside a machine are those of the
    #: strategy's own shared-memory exchange (else the copy rate measured and the model's barrier)
    in_node_measured: bool = False
    #: mean measured values per step; ``None`` where the strategy does not measure them (``ddp``'s seconds)
    measured: dict[str, float | None] = field(default_factory=dict)
    predicted: dict[str, float | None] = field(default_factory=dict)
    #: with backup workers: this rank's gradients dropped as late, and the steps it skipped
    late_gradients: int = 0
    skipped_steps: int = 0
    #: with ``on_rank_loss="continue"``: what the run lost (the strategy's ``rank_loss.metrics()``), where it lost any
    #: rank or dedicated server
    rank_loss: dict[str, Any] | None = None

    def table(self) -> str:
        """The summary as a plain-text table."""
        link = self.link
        where = "measured" if self.link_measured else "given"
        lines = [f"CommMonitor: {self.strategy}, {self.steps} optimizer steps (means per step, this rank)"]
        if link is not None:
            inside = f"inside a machine {link.local_bandwidth / 1e9:.1f} GB/s"
            if self.in_node_measured:
                inside += (f" (shared memory), {link.local_latency * 1e6:.1f} us per barrier, "
                           f"{link.overlap_slowdown:.2g}x as long beside backward")  # fmt: skip
            lines.append(f"link ({where}): latency {link.latency * 1e3:.3f} ms, bandwidth {link.bandwidth / 1e6:.1f} "
                         f"MB/s; {inside}")  # fmt: skip
        lines.append(f"{'':<22}{'measured':>14}{'predicted':>14}")
        for name in METRICS:
            lines.append(f"{name:<22}{_fmt(self.measured.get(name)):>14}{_fmt(self.predicted.get(name)):>14}")
        if self.late_gradients or self.skipped_steps:
            lines.append(f"backup workers: {self.late_gradients} late gradients dropped, {self.skipped_steps} steps "
                         "skipped")  # fmt: skip
        loss = self.rank_loss
        if loss is not None:
            for rank, cause, step, seconds in zip(loss["lost_ranks"], loss["loss_causes"], loss["loss_steps"],
                                                  loss["recovery_seconds"]):  # fmt: skip
                lines.append(
                    f"lost rank {rank} ({cause}) after {step} steps; the survivors went on {seconds:.3f} s later"
                )
            for server, seconds in zip(loss.get("lost_servers", []), loss.get("server_recovery_seconds", [])):
                lines.append(f"lost dedicated server {server}; its replica took its share over {seconds:.3f} s later")
            for server, seconds in zip(loss.get("returned_servers", []), loss.get("server_return_seconds", [])):
                lines.append(f"dedicated server {server} started again and serves again, {seconds:.3f} s after it "
                             "claimed its place")  # fmt: skip
            lines += _join_lines(loss)
            for rank, step, seconds in zip(loss.get("left_ranks", []), loss.get("leave_steps", []),
                                           loss.get("leave_pause_seconds", [])):  # fmt: skip
                lines.append(f"rank {rank} left the job on purpose after {step} steps; the members paused "
                             f"{seconds:.3f} s")  # fmt: skip
            lines.append(f"samples of global batches no survivor trained: {loss['dropped_samples']}")
            if loss.get("lost_residuals"):
                lines.append(f"error-feedback residuals lost with rank(s) {loss['lost_residuals']} (each at most one "
                             "step's rounding of its contribution)")  # fmt: skip
        return "\n".join(lines)


def _join_lines(loss: dict[str, Any]) -> list[str]:
    """The summary's lines on the new processes the run admitted (``rank_loss.metrics()``)."""
    sent = loss.get("handover_bytes", [])
    lines = []
    if loss.get("join_seconds") is not None:  # this process is a new one: its own join comes first
        rank, step = loss["joined_ranks"][0], loss["join_steps"][0]
        lines.append(f"this process joined as rank {rank} after {step} steps, {loss['join_seconds']:.3f} s after "
                     f"asking to (set-up excluded), handed {sent[0] / 1e3:.1f} kB by the members")  # fmt: skip
        loss = {**loss, **{k: loss.get(k, [])[1:] for k in ("joined_ranks", "join_steps", "handover_bytes")}}
        sent = loss["handover_bytes"]
    return lines + [
        f"a new process joined as rank {rank} after {step} steps; the members paused {pause:.3f} s, and this rank "
        f"handed it {size / 1e3:.1f} kB"
        for rank, step, pause, size in zip(
            loss.get("joined_ranks", []), loss.get("join_steps", []), loss.get("join_pause_seconds", []), sent
        )  # fmt: skip
    ]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}"


class CommMonitor(Callback):
    """Logs, per optimizer step, what synchronization did on this rank, and summarises a fit beside the cost
    model's prediction (:mod:`lightning_dp.comm.cost`).

    Per step, through the Trainer's loggers (every ``log_every_n_steps``, as ``self.log`` does): ``comm/bytes_sent``
    and ``comm/bytes_received`` (gradient and weight traffic of this rank: the strategy's own counters), and for
    this project's strategies ``comm/seconds`` (communication time, hidden or not, each exchange from when its peers
    were there: what the cost model predicts), ``comm/exposed_seconds`` (the part of it the step waited for, never
    more), ``comm/peer_wait_seconds`` (exchanges waiting for slower peers before that: a slower rank's backward, not
    the network; told apart where the transport can mark its peers' arrival: shared memory) and
    ``comm/bandwidth_MBps`` (bytes sent per second of communication). Under
    Lightning's ``ddp`` the bytes come from the model's size (the ring all-reduce's ``2 (N - 1) / N`` of the
    gradients); its communication runs inside ``DistributedDataParallel`` and is not timed.

    Values are means per optimizer step over the steps a batch closed (several with several optimizers). At the start
    of training the ranks measure their link with a short ping-pong (:func:`measure_link`, a collective: give every
    rank the callback) and, where the strategy exchanges through shared memory, that exchange's barrier and
    reduction rate and how much backward slows it on the node's cores, unless ``link`` is given (used as it is); at
    the end rank 0 prints :class:`CommSummary` (also in
    :attr:`summary` on every rank).

    Args:
        link: the network to predict for, instead of measuring it.
        prefix: the metrics' name prefix.
        print_summary: print the summary table at the end of ``fit`` (rank 0).
    """

    #: it reads counters between steps, not the weights: the servers' pull stays behind the next forward
    reads_weights = False

    def __init__(self, link: Link | None = None, prefix: str = "comm/", print_summary: bool = True) -> None:
        self.link = link
        self.prefix = prefix
        self.print_summary = print_summary
        self.summary: CommSummary | None = None
        self._cost: StepCost | None = None
        self._predicted_bytes: tuple[float, float] | None = None
        self._steps_seen = 0
        self._steps = 0
        self._last_global_step = 0
        self._totals: dict[str, float] = {}
        self._baseline: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self._backward_start = 0.0

    # ------------------------------------------------------------------ set-up
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cost = None
        if trainer.world_size == 1:  # one process synchronizes nothing
            self.summary = None
            return
        strategy = trainer.strategy
        scheme, wire, plain = self._model_of(trainer, pl_module)
        measured = self.link is None
        link, probed = (self.link, False) if self.link is not None else self._measure(trainer)
        topology = Topology(trainer.num_nodes, max(1, trainer.world_size // max(1, trainer.num_nodes)))
        self._cost = step_cost(scheme, topology, link, wire, plain)
        if isinstance(strategy, DataParallelStrategy):
            self._predicted_bytes = strategy.predicted_step_bytes()
            stats = strategy.sync_stats
            self._baseline = self._totals_of(stats)
            self._steps_seen = stats.steps
        else:
            self._predicted_bytes = rank_traffic(scheme, trainer.world_size, plain.total, trainer.global_rank)
        self._last_global_step = trainer.global_step
        self._totals = {name: 0.0 for name in (*METRICS, "backward")}
        self._steps = 0
        self.summary = CommSummary(scheme.label(), link=link, link_measured=measured, in_node_measured=probed)

    def _model_of(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[Scheme, Wire, Wire]:
        strategy = trainer.strategy
        if isinstance(strategy, DataParallelStrategy):
            wire, plain = strategy.traffic()
            return strategy.cost_scheme(), wire, plain
        params = [p for p in pl_module.parameters() if p.requires_grad]
        cap = getattr(strategy, "_ddp_kwargs", {}).get("bucket_cap_mb", 25.0)
        buckets = assign_buckets(params, int(cap * 2**20))
        plain = Wire(tuple(sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets))
        return Scheme("ddp"), plain, plain

    def _measure(self, trainer: pl.Trainer) -> tuple[Link, bool]:
        """Collective: the link between the machines (:func:`measure_link`), and inside one the strategy's own
        shared-memory exchange where it has one (CPU buckets): its barrier and reduction rate, and how much backward
        slows it on the cores the node's ranks share (:func:`core_sharing`). Returns the link, and whether the
        exchange inside a machine was measured."""
        strategy = trainer.strategy
        group = strategy.gradient_group if isinstance(strategy, DataParallelStrategy) else None
        link = measure_link(group, device=strategy.root_device)
        transport = strategy.transport if isinstance(strategy, DataParallelStrategy) else None
        probe = transport.measure_in_node() if transport is not None else None
        if probe is not None:
            ranks = max(1, trainer.world_size // max(1, trainer.num_nodes))
            slowdown = core_sharing(ranks, torch.get_num_threads(), probe.cores)
            link = replace(link, local_latency=probe.barrier_seconds, local_bandwidth=probe.reduction_bandwidth,
                           overlap_slowdown=slowdown)  # fmt: skip
        return link, probe is not None

    # ------------------------------------------------------------------ per step
    # no gradient hook here (on_after_backward, ...): unless a callback declares reads_gradients = False, the
    # parameter servers would send the averaged gradients back
    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if not isinstance(trainer.strategy, DataParallelStrategy):  # those time their own backward
            self._backward_start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = self._step_metrics(trainer) if self._cost is not None else None
        if metrics is None:
            return
        steps = int(metrics.pop("steps"))
        self._steps += steps
        for name, value in metrics.items():
            self._totals[name] += value * steps
        logged = {f"{self.prefix}{name}": value for name, value in metrics.items() if name in METRICS}
        strategy = trainer.strategy
        if getattr(strategy, "backup_workers", 0):  # running totals of this rank
            logged[f"{self.prefix}late_gradients"] = float(getattr(strategy, "late_gradients", 0))
            logged[f"{self.prefix}skipped_steps"] = float(getattr(strategy, "skipped_steps", 0))
        pl_module.log_dict(logged, on_step=True, on_epoch=False)

    @staticmethod
    def _totals_of(stats: SyncStats) -> tuple[float, ...]:
        return (*stats.steps_bytes, stats.comm_seconds, stats.exposed_comm_seconds, stats.peer_wait_seconds,
                stats.backward_seconds)  # fmt: skip

    def _step_metrics(self, trainer: pl.Trainer) -> dict[str, float] | None:
        """The mean per optimizer step of the steps this batch closed (several with several optimizers; none while
        gradients accumulate, then ``None``), and their number under ``"steps"``."""
        strategy = trainer.strategy
        if isinstance(strategy, DataParallelStrategy):
            stats = strategy.sync_stats
            steps = stats.steps - self._steps_seen
            if steps <= 0:
                return None
            self._steps_seen = stats.steps
            now = self._totals_of(stats)
            sent, received, seconds, exposed, peer_wait, backward = (b - a for a, b in zip(self._baseline, now))
            self._baseline = now
            metrics = {
                "bytes_sent": sent / steps,
                "bytes_received": received / steps,
                "seconds": seconds / steps,
                "exposed_seconds": exposed / steps,
                "peer_wait_seconds": peer_wait / steps,
                "bandwidth_MBps": sent / seconds / 1e6 if seconds > 0 else 0.0,
                "backward": backward / steps,
            }
        else:
            steps = trainer.global_step - self._last_global_step
            if steps <= 0:
                return None
            assert self._predicted_bytes is not None
            # backward and the optimizer step: an upper bound of the time backward could hide communication in
            metrics = {"bytes_sent": self._predicted_bytes[0], "bytes_received": self._predicted_bytes[1],
                       "backward": (time.perf_counter() - self._backward_start) / steps}  # fmt: skip
        self._last_global_step = trainer.global_step
        return {**metrics, "steps": float(steps)}

    # ------------------------------------------------------------------ the summary
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary, cost = self.summary, self._cost
        if summary is None or cost is None:
            return
        timed = isinstance(trainer.strategy, DataParallelStrategy)
        summary.steps = self._steps
        summary.late_gradients = getattr(trainer.strategy, "late_gradients", 0)
        summary.skipped_steps = getattr(trainer.strategy, "skipped_steps", 0)
        rank_loss = getattr(trainer.strategy, "rank_loss", None)
        lost = rank_loss.metrics() if rank_loss is not None else {}
        changed = (
            lost.get("lost_ranks")
            or lost.get("lost_servers")
            or lost.get("joined_ranks")
            or lost.get("returned_servers")
            or lost.get("left_ranks")
        )
        summary.rank_loss = lost if changed else None
        mean = {name: total / max(1, self._steps) for name, total in self._totals.items()}
        summary.measured = {name: (mean[name] if timed or name.startswith("bytes") else None) for name in METRICS}
        backward = mean["backward"]
        predicted_bytes = self._predicted_bytes or (None, None)
        summary.predicted = {
            "bytes_sent": predicted_bytes[0],
            "bytes_received": predicted_bytes[1],
            "seconds": cost.seconds,
            "exposed_seconds": cost.exposed_seconds(backward),
            "peer_wait_seconds": None,  # the model has no slow ranks
            "bandwidth_MBps": predicted_bytes[0] / cost.seconds / 1e6
            if predicted_bytes[0] is not None and cost.seconds > 0
            else None,
        }
        if self.print_summary:
            rank_zero_info(summary.table())
