"""Which strategy should I use? The cost model's prediction for a model on a cluster, every scheme ranked.

    python -m lightning_dp.advise                       # the app's config: 2 ranks on this machine
    python -m lightning_dp.advise model=reference_cnn trainer.devices=4 trainer.num_nodes=2 \
        latency_ms=10 bandwidth_mbit=1000
    python -m lightning_dp.advise --json ...            # the same as JSON

The config is the example app's (``conf/train.yaml``: model, data, trainer, global batch size) plus
``conf/advise.yaml`` (the link, when not measured). :func:`advise` measures what it is not given: the model's
synchronized bytes (its gradient buckets), one rank's forward, backward and optimizer step on a batch of the data
(``global_batch_size / world_size``), the optimizer's state, and the link (a ping-pong between two processes of this
machine; between machines pass the latency and bandwidth, or call it inside a running process group).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_dp.comm.buckets import GradientBucket, assign_buckets
from lightning_dp.comm.codecs import CODEC_NAMES, make_codec
from lightning_dp.comm.cost import Link, Prediction, Scheme, Topology, Wire, predict

#: the bucket cap of every strategy's default (``bucket_cap_mb``) and of DDP's
BUCKET_CAP_MB = 25.0
#: JSON layout version; bump when keys change
JSON_VERSION = 1
#: predicted step times within this fraction of the fastest count as a tie (the model is not that exact)
TIE = 0.02
#: how much faster a scheme that changes the training (or needs spare machines) must be to be recommended: twice
WORTH_A_CHANGE = 1.0


@dataclass
class Measured:
    """What the prediction rests on, per rank and step."""

    bucket_bytes: list[int]
    forward_seconds: float
    backward_seconds: float
    optimizer_seconds: float
    optimizer_state_bytes: int
    link: Link
    link_source: str
    #: forward-backward passes per optimizer step (``accumulate_grad_batches``)
    micro_batches: int = 1

    @property
    def compute_seconds(self) -> float:
        return self.micro_batches * (self.forward_seconds + self.backward_seconds) + self.optimizer_seconds


@dataclass
class Advice:
    """:func:`advise`'s answer: every scheme predicted, fastest first, and the recommendation with its reason."""

    model: str
    topology: Topology
    measured: Measured
    predictions: list[Prediction]
    reason: str
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Prediction:
        """The recommendation: the fastest predicted step among the schemes that train exactly as one process
        would (within :data:`TIE` of each other: the least optimizer state per rank), unless a scheme that changes
        the training (compression, staleness) or needs more machines is predicted :data:`WORTH_A_CHANGE` faster."""
        exact = [p for p in self.predictions if _departure(p.scheme) == 0]
        if not exact:
            return self.predictions[0]
        fastest = exact[0].step_seconds
        close = [p for p in exact if p.step_seconds <= fastest * (1 + TIE)]
        best = min(close, key=lambda p: (p.optimizer_state_bytes, p.step_seconds))
        other = self.predictions[0]
        if _departure(other.scheme) and other.step_seconds * (1 + WORTH_A_CHANGE) < best.step_seconds:
            return other
        return best

    def to_dict(self) -> dict[str, Any]:
        m = self.measured
        return {
            "version": JSON_VERSION,
            "model": self.model,
            "topology": {
                "num_nodes": self.topology.num_nodes,
                "ranks_per_node": self.topology.ranks_per_node,
                "world_size": self.topology.world_size,
            },  # fmt: skip
            "measured": {
                "bucket_bytes": m.bucket_bytes,
                "forward_seconds": m.forward_seconds,
                "backward_seconds": m.backward_seconds,
                "optimizer_seconds": m.optimizer_seconds,
                "optimizer_state_bytes": m.optimizer_state_bytes,
                "link": {**asdict(m.link), "source": m.link_source},
            },
            "predictions": [
                {
                    "rank": i + 1,
                    "scheme": p.scheme.label(),
                    "strategy": p.scheme.strategy,
                    "options": _options(p.scheme),
                    "communication_seconds": p.cost.seconds,
                    "exposed_seconds": p.exposed_seconds,
                    "step_seconds": p.step_seconds,
                    "message_rounds": p.cost.rounds,
                    "network_bytes": p.cost.network_bytes,
                    "optimizer_state_bytes_per_rank": p.optimizer_state_bytes,
                    "notes": p.notes,
                }
                for i, p in enumerate(self.predictions)
            ],
            "recommendation": {"scheme": self.best.scheme.label(), "reason": self.reason},
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def table(self) -> str:
        m, t = self.measured, self.topology
        link = m.link
        width = max([len("scheme"), *(len(p.scheme.label()) for p in self.predictions)]) + 2  # the longest name
        lines = [
            f"lightning-dp advise: {self.model}, {sum(m.bucket_bytes) / 2**20:.2f} MiB of gradient buckets "
            f"({len(m.bucket_bytes)} buckets), {t.world_size} ranks = {t.num_nodes} machine(s) × {t.ranks_per_node}",
            f"link ({m.link_source}): latency {link.latency * 1e3:.3f} ms, bandwidth {link.bandwidth * 8 / 1e6:.0f} "
            f"Mbit/s; per rank and step: forward {m.forward_seconds * 1e3:.1f} ms, backward "
            f"{m.backward_seconds * 1e3:.1f} ms, optimizer {m.optimizer_seconds * 1e3:.1f} ms, optimizer state "
            f"{m.optimizer_state_bytes / 2**20:.2f} MiB in one process",
            "",
            f"{'#':>2}  {'scheme':<{width}}{'comm ms':>10}{'exposed ms':>12}{'step ms':>10}{'rounds':>8}"
            f"{'state MiB':>11}  notes",
        ]
        for i, p in enumerate(self.predictions):
            lines.append(
                f"{i + 1:>2}  {p.scheme.label():<{width}}{p.cost.seconds * 1e3:>10.2f}"
                f"{p.exposed_seconds * 1e3:>12.2f}{p.step_seconds * 1e3:>10.2f}{p.cost.rounds:>8}"
                f"{p.optimizer_state_bytes / 2**20:>11.2f}  {'; '.join(p.notes)}"
            )
        lines += ["", f"recommended: {self.best.scheme.label()} — {self.reason}"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _departure(scheme: Scheme) -> int:
    """How far a scheme departs from synchronous, full-precision training on the training machines alone."""
    return (
        (scheme.compression != "none")
        + (scheme.staleness != 0)
        + (scheme.num_servers > 0)
        + (scheme.backup_workers > 0)
    )


def _options(scheme: Scheme) -> dict[str, Any]:
    return {"intra_node": scheme.intra_node, "compression": scheme.compression, "staleness": scheme.staleness,
            "num_servers": scheme.num_servers, "balance": scheme.balance,
            "backup_workers": scheme.backup_workers}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- what runs
def candidate_schemes(topology: Topology, cpu: bool = True, straggler: bool = False) -> list[Scheme]:
    """Every strategy with every option setting that changes its cost on ``topology``; on GPUs (``cpu=False``)
    without shared memory, staleness and backup workers, which run on CPUs only. With a persistent ``straggler``
    also every strategy with balanced batches and the parameter servers with one backup worker."""
    several_per_node = topology.ranks_per_node > 1
    several_nodes = topology.num_nodes > 1
    intra = ["shm", "ring"] if several_per_node and cpu else ["ring"] if several_per_node else ["shm"]
    schemes = [Scheme("ddp")]
    for strategy in ("ring_allreduce", "parameter_server", "sharded_ps"):
        for intra_node in intra:
            for compression in CODEC_NAMES:
                scheme = Scheme(strategy, intra_node, compression)
                if compression != "none" and scheme.uses_shared_memory(topology) and not several_nodes:
                    continue  # nothing crosses a network: the strategy runs uncompressed
                if strategy != "ring_allreduce" and intra_node == "ring" and several_nodes:
                    continue  # across machines the servers use sockets whatever intra_node says: the same run
                schemes.append(scheme)
        if strategy != "ring_allreduce" and cpu:
            schemes += [Scheme(strategy, staleness=1), Scheme(strategy, staleness=None)]
        if strategy != "ring_allreduce" and topology.ranks_per_node == 1 and several_nodes:
            schemes += [Scheme(strategy, num_servers=k) for k in (1, 2)]
        if straggler and topology.world_size > 1:
            schemes.append(Scheme(strategy, balance="throughput"))
            if strategy != "ring_allreduce" and cpu:
                schemes.append(Scheme(strategy, backup_workers=1))
    return schemes


def _notes(scheme: Scheme) -> list[str]:
    notes = []
    if scheme.compression != "none":
        notes.append("lossy (error feedback carries the rest)")
    if scheme.staleness != 0:
        notes.append("gains only with uneven ranks (the model assumes equal ones)")
    if scheme.num_servers:
        notes.append(f"needs {scheme.num_servers} spare machine(s)")
    if scheme.backup_workers:
        notes.append(f"each step drops the last {scheme.backup_workers} gradient(s): a smaller batch per step")
    return notes


def _reason(best: Prediction, rows: Sequence[Prediction], link: Link) -> str:
    """One line on why ``best`` wins: against the fastest scheme of another strategy, the term that differs most."""
    if _departure(best.scheme):
        exact = [p for p in rows if _departure(p.scheme) == 0]
        if exact:
            speedup = exact[0].step_seconds / best.step_seconds
            return (f"predicted step {best.step_seconds * 1e3:.2f} ms, {speedup:.2f}× faster than the best exact "
                    f"scheme ({exact[0].scheme.label()}), but {'; '.join(_notes(best.scheme))}")  # fmt: skip
    others = [p for p in rows if p.scheme.strategy != best.scheme.strategy and _departure(p.scheme) == 0]
    if not others:
        return f"predicted step {best.step_seconds * 1e3:.2f} ms"
    other = others[0]
    gain = other.step_seconds - best.step_seconds
    head = (f"predicted step {best.step_seconds * 1e3:.2f} ms vs {other.scheme.label()} "
            f"{other.step_seconds * 1e3:.2f} ms")  # fmt: skip
    latency_saved = other.cost.latency_seconds - best.cost.latency_seconds
    bytes_saved = other.cost.transfer_seconds - best.cost.transfer_seconds
    if gain <= 0.01 * max(other.step_seconds, 1e-12):
        if best.optimizer_state_bytes < other.optimizer_state_bytes:
            return (
                f"{head}: as fast, with {best.optimizer_state_bytes / max(1.0, other.optimizer_state_bytes):.2f}× "
                "the optimizer state per rank"
            )
        return f"{head}: as fast"
    if best.scheme.compression != "none" and bytes_saved >= latency_saved:
        return f"{head}: compressing with {best.scheme.compression} moves fewer bytes through the busiest link"
    if latency_saved >= bytes_saved and latency_saved > 0:
        return (f"{head}: {best.cost.rounds} message rounds per step instead of {other.cost.rounds}, and latency "
                f"({link.latencies_per_round * link.latency * 1e3:.2f} ms a round) dominates")  # fmt: skip
    if bytes_saved > 0 and best.cost.network_bytes >= other.cost.network_bytes:
        return f"{head}: as many bytes, but fewer machines sending into each link at once (incast)"
    if bytes_saved > 0:
        return (
            f"{head}: fewer bytes through the busiest machine's link ({best.cost.network_bytes / 2**20:.1f} MiB "
            f"vs {other.cost.network_bytes / 2**20:.1f} MiB)"
        )
    return f"{head}: more of its communication hides behind backward"


def wires(buckets: Sequence[GradientBucket], powersgd_rank: int = 4) -> tuple[dict[str, Wire], Wire]:
    """How ``buckets`` travel under each compression (once it runs), and uncompressed."""
    result = {name: make_codec(name, powersgd_rank=powersgd_rank).traffic(buckets) for name in CODEC_NAMES}
    return result, result["none"]


def _buckets(module: nn.Module, cap_mb: float) -> list[GradientBucket]:
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        GradientBucket(i, [params[j] for j in idx]) for i, idx in enumerate(assign_buckets(params, int(cap_mb * 2**20)))
    ]


def _first_optimizer(configured: Any) -> torch.optim.Optimizer | None:
    """The first optimizer of whatever ``configure_optimizers`` returned (Lightning's accepted forms)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None


def _timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_compute(module: nn.Module, batch: Any, repeats: int = 3) -> tuple[float, float, float, int]:
    """``(forward, backward, optimizer step)`` seconds of one rank on ``batch`` and the optimizer's state bytes
    after a step. ``module``: a LightningModule (its ``training_step`` and ``configure_optimizers``) or any module
    whose output's mean is the loss. Works on a copy: ``module`` is left as it was."""
    import copy

    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError("advise measures compute from training_step's loss, which a module with manual optimization "
                         "does not return: pass measured=Measured(...) with its times instead")  # fmt: skip
    model = copy.deepcopy(module)
    model.train()
    step = getattr(model, "training_step", None)

    def loss() -> Tensor:
        with warnings.catch_warnings():  # self.log without a Trainer
            warnings.simplefilter("ignore")
            out = step(batch, 0) if step is not None else model(batch)
        if isinstance(out, dict):
            out = out["loss"]
        return out if out.dim() == 0 else out.float().mean()

    forward = _timed(lambda: loss(), repeats)
    backward_times = []
    for _ in range(repeats + 1):
        value = loss()
        start = time.perf_counter()
        value.backward()
        backward_times.append(time.perf_counter() - start)
    backward = statistics.median(backward_times[1:])
    configure = getattr(model, "configure_optimizers", None)
    optimizer = _first_optimizer(configure()) if configure is not None else None
    if optimizer is None:
        return forward, backward, 0.0, 0
    optimizer_seconds = _timed(optimizer.step, repeats)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, Tensor))  # fmt: skip
    return forward, backward, optimizer_seconds, state


# ---------------------------------------------------------------------------------------------------- the advice
def advise(
    module: nn.Module,
    batch: Any,
    num_nodes: int = 1,
    ranks_per_node: int = 2,
    link: Link | None = None,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    schemes: Iterable[Scheme] | None = None,
    cpu: bool = True,
    measured: Measured | None = None,
    accumulate_grad_batches: int = 1,
    slowest: float = 1.0,
) -> Advice:
    """Predict every scheme for ``module`` trained on batches like ``batch`` (one rank's) by ``num_nodes`` machines
    of ``ranks_per_node`` ranks, and rank them by predicted step time (compute plus the communication the step
    waits for). ``link``: the network between machines; default: measured (inside a process group: over it,
    between rank 0 and the last rank, so every rank must call ``advise``; otherwise by two processes of this
    machine). Compute is measured on the CPU. ``cpu=False``: the ranks train on GPUs (no shared-memory transports,
    no staleness). ``measured``: skip every measurement (a prediction from known numbers). ``slowest``: one rank
    computes that many times slower than the others, persistently (the candidates then include balanced batches
    and backup workers, and each scheme's step is priced per global batch's worth of samples)."""
    if isinstance(slowest, bool) or not isinstance(slowest, (int, float)) or not 1.0 <= slowest < float("inf"):
        raise ValueError(f"slowest must be a number >= 1 (how many times slower the slowest rank is), got {slowest!r}")
    topology = Topology(num_nodes, ranks_per_node)
    buckets = _buckets(module, bucket_cap_mb)
    notes = []
    if not cpu:
        notes.append("compute was measured on this machine's CPU: the step times use CPU compute")
    if measured is None:
        forward, backward, step, state = measure_compute(module, batch)
        source = "given"
        if link is None:
            link, source = _measure_link()
            if num_nodes > 1 and source != "measured over the process group":
                notes.append("the link was measured between two processes of this machine; between machines pass "
                             "latency_ms and bandwidth_mbit")  # fmt: skip
        measured = Measured([b.nbytes for b in buckets], forward, backward, step, state, link, source,
                            accumulate_grad_batches)  # fmt: skip
    compressed, plain = wires(buckets)
    candidates = list(schemes) if schemes is not None else candidate_schemes(topology, cpu, slowest > 1.0)
    predictions = predict(candidates, topology, measured.link, compressed, plain, measured.compute_seconds,
                          measured.backward_seconds, measured.optimizer_state_bytes, slowest)  # fmt: skip
    if slowest > 1.0:
        notes.append(f"one rank computes {slowest:g}x slower than the others: step times are per global batch's "
                     "worth of samples, with that rank's compute")  # fmt: skip
    for p in predictions:
        p.notes = _notes(p.scheme)
    advice = Advice(type(module).__name__, topology, measured, predictions, "", notes)
    advice.reason = _reason(advice.best, predictions, measured.link)
    return advice


def _measure_link() -> tuple[Link, str]:
    import torch.distributed as dist

    from lightning_dp.comm.cluster.probe import measure_link, measure_this_machine

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        return measure_link(device=device), "measured over the process group"
    return measure_this_machine(), "measured between two processes of this machine"


# ---------------------------------------------------------------------------------------------------- the command
def _main(argv: list[str]) -> None:
    import hydra
    from hydra.utils import instantiate
    from omegaconf import DictConfig

    from lightning_dp import hydra_support  # noqa: F401 - the resolvers conf/train.yaml names

    as_json = "--json" in argv
    sys.argv = [a for a in argv if a != "--json"]

    @hydra.main(version_base="1.3", config_path=None, config_name="advise")  # found through hydra_plugins/
    def run(cfg: DictConfig) -> None:
        devices, nodes = cfg.trainer.devices, int(cfg.trainer.get("num_nodes", 1))
        if not isinstance(devices, int):
            raise SystemExit(f"trainer.devices={devices!r}: advise needs the number of ranks per machine, e.g. "
                             "trainer.devices=4")  # fmt: skip
        world = devices * nodes
        if cfg.global_batch_size % world:
            raise SystemExit(f"global_batch_size={cfg.global_batch_size} must be divisible by the number of "
                             f"processes ({world})")  # fmt: skip
        torch.manual_seed(cfg.seed)
        module = instantiate(cfg.model)
        batch = _one_batch(cfg, cfg.global_batch_size // world, module)
        link = None
        if cfg.latency_ms is not None or cfg.bandwidth_mbit is not None:
            if cfg.latency_ms is None or cfg.bandwidth_mbit is None:
                raise SystemExit("give both latency_ms and bandwidth_mbit (or neither: measured)")
            link = Link(float(cfg.latency_ms) / 1e3, float(cfg.bandwidth_mbit) * 1e6 / 8)
        cpu = cfg.trainer.accelerator == "cpu" or (cfg.trainer.accelerator == "auto" and not torch.cuda.is_available())
        advice = advise(module, batch, nodes, devices, link, cpu=cpu,
                        bucket_cap_mb=float(cfg.strategy.get("bucket_cap_mb", BUCKET_CAP_MB)),
                        accumulate_grad_batches=int(cfg.trainer.get("accumulate_grad_batches", 1)),
                        slowest=float(cfg.get("slowest", 1.0)))  # fmt: skip
        print(advice.to_json() if as_json else advice.table())

    run()


def _one_batch(cfg: Any, batch_size: int, module: nn.Module) -> Any:
    """One training batch of ``batch_size`` from the config's data (or the module's own loader)."""
    from hydra.utils import instantiate

    if cfg.get("data") is not None:
        datamodule = instantiate(cfg.data, batch_size=batch_size)
        datamodule.prepare_data()
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    else:
        loader = cast(Any, module).train_dataloader()
    return next(iter(loader))


if __name__ == "__main__":
    _main(sys.argv)
