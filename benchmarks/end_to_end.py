"""End-to-end benchmark: optimizer steps per second, peak memory, optimizer-state bytes and hidden communication
per rank, for every strategy against Lightning's ``ddp`` in the same run.

    python -m benchmarks.end_to_end                  # all models (below), N = 2 and 4
    python -m benchmarks.end_to_end --quick          # all models, N = 2, fewer steps
    python -m benchmarks.end_to_end --models comm_bound --strategies ddp ring_allreduce ring_allreduce@ring
    python -m benchmarks.end_to_end --pull           # the servers' pull overlapped and blocking, plain-SGD models
    python -m benchmarks.end_to_end --models comm_bound reference_cnn --world-sizes 4 --steps 60 \
        --name end_to_end_rank_loss --strategies ddp ring_allreduce ring_allreduce~continue
                                                     # what on_rank_loss="continue" costs per step
    sudo python -m benchmarks.end_to_end --emulated-hosts 3 --rate-mbit 1000 --models reference_cnn
                                                     # one node per emulated host, rate-limited links

Models: the reference CNN and ResNet-18 (compute dominates a step on CPU) and ``comm_bound``, one linear layer
with 32 MiB of gradients on batches of 4 (synchronization dominates). ``NAME@ring`` runs a strategy with
``intra_node="ring"`` (sockets inside the machine too). Each (model, N, strategy) is a separate ``Trainer.fit`` on
fake data, started the way users start it (the popen
launcher re-runs ``python -m benchmarks.end_to_end`` per rank). Steps/s is measured after warm-up steps, as the
median over ranks of (timed steps / time), and every timed step is cut into phases at Lightning's hooks (the loop
between batches, forward, backward with the exchange, the hooks before the optimizer step, the step), so the gap
to ``ddp`` is located, not guessed. Writes results/end_to_end.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import save
from lightning_dp.comm.cost import dedicated_exchange_seconds as communication_time

REPO = Path(__file__).resolve().parents[1]

STRATEGIES = ("ddp", "ring_allreduce", "parameter_server", "sharded_ps")
#: ``--pull``: the parameter servers with the weight pull behind the next forward and at the end of the step
PULL_STRATEGIES = ("ddp", "ring_allreduce", "parameter_server", "parameter_server:blocking", "sharded_ps",
                   "sharded_ps:blocking")  # fmt: skip
#: the parts of a step :class:`PhaseTimer` (in the worker) measures, in order
PHASES = ("loop", "forward", "backward", "hooks", "step")
MODELS = {
    # name: (image shape, per-rank batch)
    "reference_cnn": ((1, 28, 28), 64),
    "resnet18": ((3, 32, 32), 32),
    # one linear layer with 32 MiB of gradients and tiny batches: synchronization dominates each step
    "comm_bound": ((1, 64, 64), 4),
    # the multi-layer models with plain SGD (no momentum: the optimizer's own step is the cheapest), small and large
    # batches: the parameter servers' weight pull is the largest part of their step that ddp does not have
    "reference_cnn_sgd_b2": ((1, 28, 28), 2),
    "reference_cnn_sgd_b32": ((1, 28, 28), 32),
    "resnet18_sgd_b2": ((3, 32, 32), 2),
    "resnet18_sgd_b32": ((3, 32, 32), 32),
}
#: the learning rate of the plain-SGD models
SGD_LR = 0.01
#: the models a run without ``--models`` measures, and those of ``--pull``
DEFAULT_MODELS = ("comm_bound", "reference_cnn", "resnet18")
PULL_MODELS = tuple(name for name in MODELS if "_sgd_" in name)


def build_model(name: str):
    import torch
    import torch.nn.functional as F
    from lightning import LightningModule

    from lightning_dp.demos import ReferenceCNN

    if "_sgd_" in name:
        model = build_model(name.split("_sgd_")[0])
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=SGD_LR)
        return model
    if name == "reference_cnn":
        return ReferenceCNN(dropout=0.0)

    if name == "comm_bound":

        class CommBound(LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64 * 64, 2048))

            def training_step(self, batch, batch_idx):
                x, y = batch
                return F.cross_entropy(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

        return CommBound()

    class ResNet18(LightningModule):
        def __init__(self):
            super().__init__()
            import torchvision

            self.net = torchvision.models.resnet18(num_classes=10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return ResNet18()


#: torch's own DDP communication hooks, as ``ddp+<name>``
DDP_HOOKS = ("fp16_hook", "bf16_hook", "powersgd_hook")
#: the PowerSGD settings every PowerSGD run here uses (ours and torch's): rank 4, compression from the 2nd step
POWERSGD_RANK, POWERSGD_START = 4, 2


def build_strategy(spec: str, external_servers: bool = False, backend: str | None = None):
    """``(strategy, callbacks)`` for a strategy spec: a registry name, ``NAME#K`` (``num_servers=K`` dedicated
    servers, started elsewhere with ``external_servers``), ``NAME@ring`` (``intra_node="ring"``),
    ``NAME+CODEC`` (``compression=CODEC``, e.g. ``ring_allreduce@ring+bf16``), ``NAME:blocking`` (a parameter server
    with ``overlap_pull=False``: the weight pull at the end of the step), ``NAME~MODE`` (``on_rank_loss=MODE``,
    anywhere after the name, e.g. ``ring_allreduce@ring~continue``), or ``ddp+HOOK`` (Lightning's
    ``ddp`` with one of torch's communication hooks, :data:`DDP_HOOKS`, registered on the DDP module at the start of
    training: Lightning registers hooks itself only on CUDA). ``backend``: every strategy's process-group backend
    (``ddp``'s included; default each one's own)."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import StrategyRegistry

    rank_loss = ""
    found = re.search(r"~(\w+)", spec)
    if found:
        rank_loss, spec = found[1], spec[: found.start()] + spec[found.end() :]
    name, _, codec = spec.partition("+")
    if name == "ddp" and codec:
        if codec not in DDP_HOOKS:
            raise ValueError(f"ddp+{codec}: choose one of {DDP_HOOKS}")

        class RegisterHook(Callback):
            def on_train_start(self, trainer, pl_module):
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

                ddp = trainer.strategy.model
                if codec == "powersgd_hook":
                    state = powerSGD_hook.PowerSGDState(
                        process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                        start_powerSGD_iter=POWERSGD_START,
                    )  # fmt: skip
                    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
                else:
                    fp16 = codec == "fp16_hook"
                    ddp.register_comm_hook(
                        None, default_hooks.fp16_compress_hook if fp16 else default_hooks.bf16_compress_hook
                    )

        if codec != "powersgd_hook":
            return "ddp", [RegisterHook()]
        # torch's powerSGD_hook issues each bucket's all-reduces of P and Q from futures' callbacks; on gloo, with
        # several buckets in flight, ranks then issue them in different orders (a collective mismatch: "Received
        # data size doesn't match expected size"; across the emulated hosts most runs failed), so here it gets one
        # bucket (3 of 3 runs then succeeded)
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(bucket_cap_mb_list=[1024]), [RegisterHook()]
    if name == "ddp" and backend:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=backend), []
    name, _, pull = name.partition(":")
    if pull not in ("", "blocking"):
        raise ValueError(f"{spec}: the only pull mode to name is ':blocking' (overlap_pull=False)")
    name, _, intra_node = name.partition("@")
    name, _, servers = name.partition("#")
    options: dict = {"process_group_backend": backend} if backend else {}
    if pull:
        options["overlap_pull"] = False
    if servers:
        options.update(num_servers=int(servers), start_servers=not external_servers)
    if intra_node:
        options["intra_node"] = intra_node
    if codec:
        options.update(compression=codec, powersgd_rank=POWERSGD_RANK, powersgd_warmup_steps=POWERSGD_START)
    if rank_loss:
        options["on_rank_loss"] = rank_loss
    if not options:
        return name, []
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **options}), []


def worker(args) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    import lightning_dp  # noqa: F401 - registers the strategies
    from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
    from lightning_dp.demos import FakeDataModule

    register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    shape, batch = MODELS[args.model]

    class StepTimer(Callback):
        reads_weights = False  # so the parameter servers' pull stays behind the next forward

        def __init__(self):
            self.times = []
            self.cpu_times = []  # this process's CPU seconds, all its threads
            self.comm_at_warmup = 0.0
            self.exposed_at_warmup = 0.0
            self.pull_at_warmup = 0.0
            self.pull_at_end = None
            self.isolated_exchange_seconds = None

        def on_train_batch_end(self, trainer, *_):
            if trainer.strategy.root_device.type == "cuda":  # the step's kernels done, not only launched
                torch.cuda.synchronize(trainer.strategy.root_device)
            self.times.append(time.perf_counter())
            self.cpu_times.append(time.process_time())
            self.pull_at_end = pull_seconds(trainer.strategy)  # the pull the forwards waited for up to this step
            if len(self.times) == args.warmup:
                stats = getattr(trainer.strategy, "sync_stats", None)  # ddp has none
                self.comm_at_warmup = stats.comm_seconds if stats is not None else 0.0
                self.exposed_at_warmup = stats.exposed_comm_seconds if stats is not None else 0.0
                self.pull_at_warmup = pull_seconds(trainer.strategy)

        def on_train_end(self, trainer, *_):
            # the same exchange with every rank starting it together: its cost with no slower peer to wait for
            measure = getattr(trainer.strategy, "measure_exchange_seconds", None)
            self.isolated_exchange_seconds = measure() if measure is not None else None

    class PhaseTimer(Callback):
        """Where each timed step goes, from Lightning's hooks: the loop between batches (data, Lightning's
        bookkeeping), forward (to ``on_before_backward``), backward (to ``on_after_backward``: the strategies'
        gradient exchange completes inside it, as DDP's reducer does), the hooks between backward and the optimizer
        step (gradient checks and edits), and the step (clipping, the optimizer, the servers' weight pull). On a GPU
        the marks are the host's view (kernels run on asynchronously) but for the step's end, which
        :class:`StepTimer`, called first, waits for. It reads no gradient, and says so: the parameter servers keep
        the step they run without it (no averaged gradients sent back, dedicated servers updating as buckets
        arrive)."""

        reads_gradients = False
        reads_weights = False

        def __init__(self):
            self.marks: dict[str, float] = {}
            self.totals = dict.fromkeys(PHASES, 0.0)
            self.steps = 0
            self.last_end: float | None = None

        def on_train_batch_start(self, trainer, *_):
            self.marks["start"] = time.perf_counter()

        def on_before_backward(self, trainer, *_):
            self.marks["backward"] = time.perf_counter()

        def on_after_backward(self, trainer, *_):
            self.marks["hooks"] = time.perf_counter()

        def on_before_optimizer_step(self, trainer, *_):
            self.marks["step"] = time.perf_counter()

        def on_train_batch_end(self, trainer, *_):
            self.marks["end"] = time.perf_counter()
            m = self.marks
            if trainer.global_step > args.warmup and self.last_end is not None and len(m) == 5:
                for phase, (a, b) in zip(PHASES, [(None, "start"), ("start", "backward"), ("backward", "hooks"),
                                                   ("hooks", "step"), ("step", "end")]):  # fmt: skip
                    self.totals[phase] += m[b] - (self.last_end if a is None else m[a])
                self.steps += 1
            self.last_end = m["end"]
            self.marks = {}

    timer, phases = StepTimer(), PhaseTimer()
    strategy, callbacks = build_strategy(args.strategy, args.external_servers, args.backend)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, phases, *callbacks],
    )
    world = args.devices * args.num_nodes
    data = FakeDataModule(num_samples=batch * world * (args.warmup + args.steps), image_shape=shape, batch_size=batch)
    model = build_model(args.model)
    trainer.fit(model, datamodule=data)
    # every timed step cut into its phases: one optimizer step per batch, as these models take
    assert phases.steps == args.steps, f"{phases.steps} of {args.steps} timed steps were cut into phases"
    strategy = trainer.strategy
    stats = getattr(strategy, "sync_stats", None)
    timed = timer.times[args.warmup - 1 :]
    if hasattr(strategy, "optimizer_state_bytes"):
        state_bytes = strategy.optimizer_state_bytes()
    else:
        state_bytes = sum(
            v.numel() * v.element_size()
            for o in trainer.optimizers
            for s in o.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        )
    result = {
        "rank": trainer.global_rank,
        "steps_per_s": (len(timed) - 1) / (timed[-1] - timed[0]),
        "cpu_seconds_per_step": (timer.cpu_times[-1] - timer.cpu_times[args.warmup - 1]) / (len(timed) - 1),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "optimizer_state_bytes": state_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "comm_seconds": stats.comm_seconds if stats is not None else None,
        "exposed_comm_seconds": stats.exposed_comm_seconds if stats is not None else None,
        "comm_seconds_per_step": ((stats.comm_seconds if stats else 0.0) - timer.comm_at_warmup) / args.steps,
        "exposed_comm_seconds_per_step": ((stats.exposed_comm_seconds if stats else 0.0) - timer.exposed_at_warmup)
        / args.steps,
        "isolated_exchange_seconds": timer.isolated_exchange_seconds,
        "pull_wait_seconds_per_step": (timer.pull_at_end - timer.pull_at_warmup) / args.steps
        if timer.pull_at_end is not None
        else None,
        "phase_ms_per_step": {k: 1000 * v / max(1, phases.steps) for k, v in phases.totals.items()},
        "sync_bytes": stats.bucket_bytes if stats is not None else None,
        "last_step_bytes": list(stats.last_step_bytes) if stats is not None else None,
    }
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.result_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def pull_seconds(strategy) -> float | None:
    """Seconds the training loop spent in the servers' weight pull so far (waiting for it, writing the weights), for
    the parameter servers among the trainers; ``None`` for the others."""
    weights = getattr(getattr(strategy, "engine", None), "weights", None)
    return weights.waited_seconds if weights is not None else None


def hidden_fraction(ranks: list[dict]) -> float:
    """The share of one exchange's cost that backward hid, averaged over ranks: 1 - (seconds per timed step that a
    rank waited for communication after its own backward, plus blocking weight pulls) / (seconds the same exchange
    takes when every rank starts it together, measured in the same run). Waiting for a slower peer's backward
    counts as exposed, never as hidden; the share is clipped to [0, 1]."""
    shares = [
        min(1.0, max(0.0, 1 - r["exposed_comm_seconds_per_step"] / r["isolated_exchange_seconds"])) for r in ranks
    ]
    return sum(shares) / len(shares)


def worker_command(
    model: str, strategy: str, devices: int, steps: int, warmup: int, result_dir: Path, num_nodes: int = 1,
    accelerator: str = "cpu", backend: str | None = None, external_servers: bool = False,
) -> list[str]:  # fmt: skip
    """The command that runs one measurement (Lightning starts the node's other ranks); ``NAME#K``'s servers are
    started by trainer 0 on its machine, or elsewhere with ``external_servers``."""
    return [
        sys.executable, "-m", "benchmarks.end_to_end", "--worker", "--model", model, "--devices", str(devices),
        "--num-nodes", str(num_nodes), "--strategy", strategy, "--steps", str(steps), "--warmup", str(warmup),
        "--result-dir", str(result_dir), "--accelerator", accelerator, *(["--backend", backend] if backend else []),
        *(["--external-servers"] if external_servers and "#" in strategy else []),
    ]  # fmt: skip


def run_emulated(
    model: str, hosts: int, rate_mbit: float, strategy: str, steps: int, warmup: int, tmp: Path
) -> list[dict]:
    """One Lightning node per emulated host (network namespace), links shaped to ``rate_mbit``."""
    from benchmarks.netns import IFNAME, SUBNET, emulated_hosts, node_ranks, run_in_hosts, server_command

    result_dir = tmp / f"emulated-{model}-{hosts}-{strategy}"
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": f"{SUBNET}.1",
        "MASTER_PORT": "29800",
        "GLOO_SOCKET_IFNAME": IFNAME,
    }
    servers = int(strategy.partition("#")[2].partition("@")[0] or 0)  # dedicated servers, each on a host of its own
    with emulated_hosts(hosts + servers, rate_mbit) as namespaces:
        trainers = [
            (ns, worker_command(model, strategy, 1, steps, warmup, result_dir, hosts, external_servers=True))
            for ns in namespaces[:hosts]
        ]
        dedicated = [(ns, server_command(f"{SUBNET}.1", env["MASTER_PORT"], j, servers))
                     for j, ns in enumerate(namespaces[hosts:])]  # fmt: skip
        run_in_hosts([*trainers, *dedicated], env, 1800, [*node_ranks(hosts), *([{}] * servers)],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(hosts)]


def emulated_report(rows: list[dict]) -> list[str]:
    """The table of ``rows`` from emulated hosts (``Machine: ...`` first)."""
    hosts, rate_mbit, steps = rows[0]["hosts"], rows[0]["rate_mbit"], rows[0]["steps"]
    b = rate_mbit * 1e6 / 8
    lines = [
        f"Machine: {os.cpu_count()} CPUs; {hosts} hosts in network namespaces, links shaped to {rate_mbit:g} Mbit/s "
        f"both ways; {steps} timed steps",
        "",
        "| model | strategy | steps/s | vs ddp | S (MB) | comm s/step (max over ranks) | analytic s/step "
        "| measured / analytic |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["strategy"] == "ddp":
            lines.append(f"| {r['model']} | ddp | {r['steps_per_s']:.2f} | 1.00 | | | | |")
            continue
        s = r["sync_bytes"]
        name, _, servers = r["strategy"].partition("@")[0].partition("#")
        if servers:  # dedicated servers: the optimal split (sharded) or S / B per trainer, n S / k per server
            k = int(servers)
            analytic = communication_time(hosts, k, s, b) if name == "sharded_ps" else max(1.0, hosts / k) * s / b
        else:
            factor = 2 * (hosts - 1) if name == "parameter_server" else 2 * (hosts - 1) / hosts
            analytic = factor * s / b
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['steps_per_s']:.2f} | {r['vs_ddp']:.2f} | {s / 2**20:.1f} | "
            f"{r['comm_s_per_step']:.3f} | {analytic:.3f} | {r['comm_s_per_step'] / analytic:.2f} |"
        )
    timed = [r for r in rows if "phase_ms_per_step" in r]
    if timed:
        lines += [
            "",
            *phase_lines(timed),
            "",
            "The exchange inside the step against the same exchange alone (every trainer starting it together after "
            f"training, measured in the same run), and each trainer's CPU time per step (all its threads; the "
            f"{os.cpu_count()} cores are shared by every trainer and server):",
            "",
            "| model | strategy | exchange alone ms | comm in the step ms (max over ranks) | trainer CPU ms/step |",
            "|---|---|---|---|---|",
        ]
        for r in timed:
            alone = f"{r['isolated_exchange_ms']:.0f}" if "isolated_exchange_ms" in r else "n/a"
            comm = f"{1000 * r['comm_s_per_step']:.0f}" if r["strategy"] != "ddp" else "n/a"
            cpu = r["trainer_cpu_ms_per_step"]
            lines.append(f"| {r['model']} | {r['strategy']} | {alone} | {comm} | {cpu:.0f} |")
    return lines


def run_case(model: str, devices: int, strategy: str, steps: int, warmup: int, tmp: Path) -> list[dict]:
    result_dir = tmp / f"{model}-{devices}-{strategy}"
    cmd = worker_command(model, strategy, devices, steps, warmup, result_dir)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(devices)]


def median(values):
    values = sorted(values)
    return (
        values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="reference_cnn")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--accelerator", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--emulated-hosts", type=int, default=0, help="run one node per emulated host (needs root)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate of the emulated hosts")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-sizes", type=int, nargs="+")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS))
    parser.add_argument(
        "--strategies", nargs="+", default=None,
        help="registry names; NAME@ring runs NAME with intra_node='ring' (sockets inside the machine too)",
    )  # fmt: skip
    parser.add_argument("--result-dir", default="")
    parser.add_argument("--external-servers", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="", help="results/<name>.{json,md} instead of the default name")
    parser.add_argument(
        "--pull", action="store_true",
        help="the servers' weight pull overlapped and blocking on the plain-SGD models: --models and --strategies "
        "default to those, results/end_to_end_sgd",
    )  # fmt: skip
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import tempfile

    steps = args.steps or (10 if args.quick else 30)
    world_sizes = args.world_sizes or ([2] if args.quick else [2, 4])
    models = args.models or list(PULL_MODELS if args.pull else DEFAULT_MODELS)
    args.strategies = args.strategies or list(PULL_STRATEGIES if args.pull else STRATEGIES)
    args.name = args.name or ("end_to_end_sgd" if args.pull else "")
    rows = []
    if args.emulated_hosts:
        with tempfile.TemporaryDirectory() as tmp:
            for model in models:
                for strategy in args.strategies:
                    ranks = run_emulated(
                        model, args.emulated_hosts, args.rate_mbit, strategy, steps, args.warmup, Path(tmp)
                    )
                    row = {
                        "model": model,
                        "strategy": strategy,
                        "hosts": args.emulated_hosts,
                        "rate_mbit": args.rate_mbit,
                        "steps": steps,
                        "steps_per_s": median([r["steps_per_s"] for r in ranks]),
                        "sync_bytes": ranks[0]["sync_bytes"],
                        "comm_s_per_step": max(r["comm_seconds_per_step"] for r in ranks),
                        "world_size": args.emulated_hosts,
                        "phase_ms_per_step": {
                            phase: median([r["phase_ms_per_step"][phase] for r in ranks]) for phase in PHASES
                        },
                        "trainer_cpu_ms_per_step": 1000 * median([r["cpu_seconds_per_step"] for r in ranks]),
                    }
                    if ranks[0]["isolated_exchange_seconds"]:
                        row["exposed_ms_per_step"] = 1000 * median([r["exposed_comm_seconds_per_step"] for r in ranks])
                        row["isolated_exchange_ms"] = 1000 * median([r["isolated_exchange_seconds"] for r in ranks])
                    if strategy == "ddp":
                        baseline = row
                    row["vs_ddp"] = row["steps_per_s"] / baseline["steps_per_s"]
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        save(args.out, args.name or "end_to_end_emulated", rows, emulated_report)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for n in world_sizes:
                baseline = None
                for strategy in args.strategies:
                    ranks = run_case(model, n, strategy, steps, args.warmup, Path(tmp))
                    row = {
                        "model": model,
                        "world_size": n,
                        "strategy": strategy,
                        "steps": steps,
                        "warmup": args.warmup,
                        "params": ranks[0]["params"],
                        "steps_per_s": median([r["steps_per_s"] for r in ranks]),
                        "peak_rss_mb_max": max(r["peak_rss_mb"] for r in ranks),
                        "optimizer_state_mb": [round(r["optimizer_state_bytes"] / 2**20, 2) for r in ranks],
                    }
                    row["phase_ms_per_step"] = {
                        phase: median([r["phase_ms_per_step"][phase] for r in ranks]) for phase in PHASES
                    }
                    if ranks[0].get("pull_wait_seconds_per_step") is not None:
                        row["pull_wait_ms_per_step"] = 1000 * median([r["pull_wait_seconds_per_step"] for r in ranks])
                    if ranks[0]["isolated_exchange_seconds"]:
                        row["hidden_comm_fraction"] = hidden_fraction(ranks)
                        row["exposed_ms_per_step"] = 1000 * median([r["exposed_comm_seconds_per_step"] for r in ranks])
                        row["isolated_exchange_ms"] = 1000 * median([r["isolated_exchange_seconds"] for r in ranks])
                    if strategy == "ddp":
                        baseline = row
                    row["vs_ddp"] = row["steps_per_s"] / baseline["steps_per_s"]
                    ddp_state = max(baseline["optimizer_state_mb"])
                    states = row["optimizer_state_mb"]
                    row["state_vs_ddp"] = [round(s / ddp_state, 3) if ddp_state else None for s in states]
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    save(args.out, args.name or "end_to_end", rows, report_lines)


def report_lines(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first)."""
    steps, warmup = rows[0]["steps"], rows[0]["warmup"]
    lines = [
        f"Machine: {os.cpu_count()} CPUs, gloo over loopback; {steps} timed steps after {warmup} warm-up steps",
        "",
        "hidden comm: 1 - (time a rank waited for communication after its own backward, per step) / (the same exchange"
        " with every rank starting it together, measured in the same run), mean over ranks; waiting for a slower"
        " peer counts as exposed.",
        "",
        "| model | N | strategy | steps/s | vs ddp | hidden comm | exposed ms/step | exchange ms | peak RSS MB "
        "| optimizer state MB per rank | state vs ddp |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hidden = f"{r['hidden_comm_fraction']:.0%}" if "hidden_comm_fraction" in r else "n/a"
        exposed = f"{r['exposed_ms_per_step']:.1f}" if "exposed_ms_per_step" in r else "n/a"
        exchange = f"{r['isolated_exchange_ms']:.1f}" if "isolated_exchange_ms" in r else "n/a"
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.1f}M) | {r['world_size']} | {r['strategy']} "
            f"| {r['steps_per_s']:.2f} | "
            f"{r['vs_ddp']:.2f} | {hidden} | {exposed} | {exchange} | {r['peak_rss_mb_max']:.0f} | "
            f"{r['optimizer_state_mb']} | {r['state_vs_ddp']} |"
        )
    timed = [r for r in rows if "phase_ms_per_step" in r]
    if timed:
        lines += ["", *phase_lines(timed)]
    return lines


def phase_lines(rows: list[dict]) -> list[str]:
    """The table of where each timed step of ``rows`` went, by phase, with its legend."""
    lines = [
        "Where a step goes, ms per timed step (median over ranks): loop (between batches: data, Lightning), "
        "forward, backward (the strategies' exchange completes in it, as DDP's reducer's does), hooks (between "
        "backward and the optimizer step; with dedicated servers' overlapped update, the wait for it), step "
        "(clipping, optimizer, the servers' weight pull at the end of the step); the phases tile the step, so "
        "they add up to 1000 / steps per second; `waited` is the part of them spent waiting for communication; "
        "`pull` is the time the training loop spent in the servers' weight pull (waiting for it, and writing the "
        "weights into the parameters): in the step phase with `:blocking`, in the forward otherwise.",
        "",
        "| model | N | strategy | loop | forward | backward | hooks | step | waited | pull |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        phases = r["phase_ms_per_step"]
        cells = " | ".join(f"{phases[p]:.1f}" for p in PHASES)
        waited = f"{r['exposed_ms_per_step']:.1f}" if "exposed_ms_per_step" in r else "n/a"
        pull = f"{r['pull_wait_ms_per_step']:.1f}" if "pull_wait_ms_per_step" in r else "n/a"
        lines.append(f"| {r['model']} | {r['world_size']} | {r['strategy']} | {cells} | {waited} | {pull} |")
    return lines


if __name__ == "__main__":
    main()


def pull_lines(rows: list[dict]) -> list[str]:
    """The parameter servers with the weight pull behind the next forward and at the end of the step (``:blocking``)
    against the ring, per model and N: steps/s over ``ddp``'s, the servers' ratio as a share of the ring's, and the
    time the training loop spent in the pull per step (median over ranks)."""
    lines = [
        "| model | N | `ring_allreduce` | `parameter_server` (blocking) | `sharded_ps` (blocking) "
        "| `parameter_server` / ring | `sharded_ps` / ring | pull ms/step, `parameter_server` (blocking) "
        "| pull ms/step, `sharded_ps` (blocking) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, n in dict.fromkeys((r["model"], r["world_size"]) for r in rows):
        by = {r["strategy"]: r for r in rows if (r["model"], r["world_size"]) == (model, n)}
        ring = by["ring_allreduce"]["vs_ddp"]

        def pair(name: str, key: str, unit: str = "", by: dict = by) -> str:
            fmt = "{:.2f}" if unit == "×" else "{:.1f}"
            return f"{fmt.format(by[name][key])}{unit} ({fmt.format(by[name + ':blocking'][key])}{unit})"

        lines.append(
            f"| {model} | {n} | {ring:.2f}× | {pair('parameter_server', 'vs_ddp', '×')} "
            f"| {pair('sharded_ps', 'vs_ddp', '×')} | {by['parameter_server']['vs_ddp'] / ring:.0%} "
            f"| {by['sharded_ps']['vs_ddp'] / ring:.0%} | {pair('parameter_server', 'pull_wait_ms_per_step')} "
            f"| {pair('sharded_ps', 'pull_wait_ms_per_step')} |"
        )
    return lines
