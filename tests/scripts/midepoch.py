"""Train a model whose only randomness is the data order, with checkpoints every few steps; resume from one, or
(under torchrun) kill a rank at a step and resume from the newest checkpoint in the restarted attempt.

Every rank writes ``<out>/rank<r>.pt``: its final weights, the sample indices it trained batch by batch in this
process (a resumed run: from the checkpoint on; ``None`` for a batch it skipped), ``(epoch, batch index, weights
after the batch)`` of each of those batches, the checkpoint it resumed from, with ``--balance throughput`` the
schedule of batch shares, and with ``--backup-workers`` which of its batches' gradients came late and what its
server dropped.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_dp  # noqa: F401 - registers the strategies
from lightning_dp import CommMonitor
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="ring_allreduce")
parser.add_argument("--devices", default="2")
parser.add_argument(
    "--num-nodes",
    type=int,
    default=1,
    help="with LIGHTNING_DP_TEST_NODES: that many single-device "
    "nodes, each process started by the test (Lightning's general cluster environment)",
)
parser.add_argument("--max-epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--global-batch", type=int, default=None,
                    help="each rank's training batch is this over the ranks it was started for (as the app's "
                    "global_batch_size), instead of --batch-size")  # fmt: skip
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--checkpoint-every", type=int, default=3, help="ModelCheckpoint every n steps into <out>/ckpt")
parser.add_argument("--resume-from", default=None, help="a checkpoint, or 'newest' (the newest in <out>/ckpt)")
parser.add_argument("--kill-rank", type=int, default=1)
parser.add_argument("--kill-at-step", type=int, default=None, help="attempt 0: SIGKILL --kill-rank after this step")
parser.add_argument("--pause-at-step", type=int, default=None,
                    help="attempt 0: each rank writes <out>/paused-rank<r> after this step, then waits")  # fmt: skip
parser.add_argument("--variables-environment", action="store_true",
                    help="ranks started by the test itself, told their place by RANK, WORLD_SIZE, LOCAL_RANK, "
                         "NODE_RANK (a cluster that starts the processes, as Ray Train and SLURM do)")  # fmt: skip
parser.add_argument("--balance", default=None, help="strategy option balance")
parser.add_argument("--balance-interval", type=int, default=None, help="strategy option balance_interval")
parser.add_argument("--lr-every-step", action="store_true", help="the scheduler steps after every optimizer step")
parser.add_argument("--backup-workers", type=int, default=None, help="strategy option backup_workers")
parser.add_argument("--slow-rank", type=int, default=None, help="this rank sleeps --slow-per-sample x its batch size")
parser.add_argument("--slow-per-sample", type=float, default=0.0)
parser.add_argument("--stall-at-step", type=int, default=None, help="--slow-rank sleeps --stall-seconds once, here")
parser.add_argument("--stall-seconds", type=float, default=0.0)
parser.add_argument("--on-rank-loss", default=None, help="strategy option on_rank_loss")
parser.add_argument("--intra-node", default=None, help="strategy option intra_node")
parser.add_argument("--compression", default=None, help="strategy option compression")
parser.add_argument("--heartbeat-timeout", type=float, default=None, help="strategy option heartbeat_timeout")
parser.add_argument("--lose-rank", type=int, default=None,
                    help="this rank SIGKILLs itself in the training step of --lose-at-step")  # fmt: skip
parser.add_argument("--lose-at-step", type=int, default=None)
parser.add_argument("--lose-after-fit", action="store_true", help="--lose-rank dies once the fit has ended")
parser.add_argument("--lose-later", type=int, nargs=2, default=None, metavar=("RANK", "STEP"),
                    help="a second rank SIGKILLs itself in the training step of STEP")  # fmt: skip
parser.add_argument("--lose-while-joining", type=int, default=None, metavar="RANK",
                    help="this rank SIGKILLs itself in the first training step a new process is dealt a share and not "
                    "admitted yet")  # fmt: skip
parser.add_argument("--record-seen", action="store_true",
                    help="every rank writes what it trains, step by step, to <out>/seen-rank<r>.txt")  # fmt: skip
parser.add_argument("--mark-step", type=int, default=None,
                    help="each rank touches <out>/at-step-<k>-rank<r> as its training step k starts")  # fmt: skip
parser.add_argument("--step-seconds", type=float, default=0.0, help="every rank sleeps this long in every step")
parser.add_argument("--refit-epochs", type=int, default=None,
                    help="after the fit, fit again this many epochs with a new Trainer and strategy (the same job); "
                         "<out>/refit-rank<r>.pt: what that fit trained")  # fmt: skip
parser.add_argument("--lose-after-backward", action="store_true",
                    help="--lose-rank dies after its backward (its exchange of the step complete) instead")  # fmt: skip
parser.add_argument("--slow-commit-rank", type=int, default=None,
                    help="this rank commits the exchange of --lose-at-step only once the lost rank died")  # fmt: skip
parser.add_argument("--measure-exchange", action="store_true",
                    help="every rank times a synchronization as training starts")  # fmt: skip
parser.add_argument("--collectives", action="store_true",
                    help="each step logs its loss with sync_dist and all-gathers the ranks training")  # fmt: skip
parser.add_argument("--validate", action="store_true", help="validate each epoch, logging with sync_dist")
parser.add_argument(
    "--lose-in-pull",
    action="store_true",
    help="--lose-rank dies as its weight pull of --lose-at-step starts (the servers)",
)
parser.add_argument("--clip-norm", type=float, default=None, help="gradient_clip_val, by norm")
parser.add_argument(
    "--read-gradients",
    action="store_true",
    help="a callback reads the averaged gradients before each step (the servers then send them back)",
)
parser.add_argument("--num-servers", type=int, default=None, help="strategy option num_servers")
parser.add_argument("--external-servers", action="store_true", help="start_servers=False: the test starts them")
parser.add_argument(
    "--lose-server",
    type=int,
    nargs=2,
    action="append",
    default=[],
    metavar=("SERVER", "STEP"),
    help="trainer 0 SIGKILLs the dedicated server it started, at STEP (see --lose-server-when); repeatable",
)
parser.add_argument(
    "--replace-server",
    type=int,
    nargs=2,
    action="append",
    default=[],
    metavar=("SERVER", "STEP"),
    help="trainer 0 starts python -m lightning_dp.server again for the lost SERVER in its training step of STEP, and "
    "waits there until the new process claimed the server's place",
)
parser.add_argument("--restart-lost-servers", type=int, default=None, help="strategy option restart_lost_servers")
parser.add_argument("--await-server-return", type=int, nargs=2, default=None, metavar=("SERVER", "STEP"),
                    help="trainer 0 waits in its training step of STEP until the leader saw SERVER's new process "
                    "claim its place (so that it is let in before a later step's loss)")  # fmt: skip
parser.add_argument(
    "--kill-returning-server",
    action="store_true",
    help="trainer 0 SIGKILLs the server it started again as the trainers let it in (it is taking its shares back)",
)
parser.add_argument(
    "--lose-server-when",
    choices=("flight", "exchange", "pull"),
    default="flight",
    help="in the training step, after backward, or once the step's request went to the servers",
)
parser.add_argument(
    "--silent-server",
    action="store_true",
    help="--lose-server's servers are SIGSTOPped (silent, their connections open: a host cut off), not SIGKILLed",
)
parser.add_argument(
    "--kill-in-handover",
    type=int,
    default=None,
    metavar="RANK",
    help="RANK (a member handing a new process the job's state, or the new process) dies as the handover begins",
)
parser.add_argument("--restart-lost-ranks", type=int, default=None, help="strategy option restart_lost_ranks")
parser.add_argument("--max-ranks", type=int, default=None, help="strategy option max_ranks")
parser.add_argument("--await-replacement-at", type=int, default=None, metavar="STEP",
                    help="the leader (rank 0, or the lowest rank left) waits in this step until the lost rank's "
                         "replacement asked to join")  # fmt: skip
parser.add_argument("--leave", type=int, nargs=2, default=None, metavar=("RANK", "STEP"),
                    help="RANK asks to leave the job in STEP (SIGUSR2 to itself, or --leave-by call)")  # fmt: skip
parser.add_argument("--leave-by", choices=("signal", "call"), default="signal")
parser.add_argument("--refuse-leave", type=int, nargs=2, default=None, metavar=("RANK", "STEP"),
                    help="RANK calls strategy.leave() in STEP (refused: <out>/leave-refused-rank<r>.txt)")  # fmt: skip
parser.add_argument("--out", required=True)
args = parser.parse_args()
#: started again in place of a rank this run killed (tests.helpers.launch.run_script's replace_killed)
REPLACEMENT = os.environ.get("LIGHTNING_DP_TEST_REPLACEMENT") == "1" or "LIGHTNING_DP_RESTART" in os.environ
#: --lose-server's steps and the server lost at each
server_losses = {step: server for server, step in args.lose_server}
#: --replace-server's steps and the server started again at each; the processes started
server_returns = {step: server for server, step in args.replace_server}
started_again: list[subprocess.Popen] = []
out = Path(args.out)


class IndexedData(Dataset):
    """Sample i is (i, features of i): the trained indices can be recorded."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        self.trained: list[list[int]] = []
        self.history: list[tuple[int, int, torch.Tensor]] = []
        self.current: list[int] | None = None
        self.late: list[bool] = []
        self.late_so_far = 0
        self.gathered: list[list[int]] = []
        self.world_sizes: list[int] = []
        self.validated: list[tuple[int, list[int]]] = []
        self.step_ends: list[float] = []

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        if self.global_rank == args.slow_rank:
            time.sleep(args.slow_per_sample * len(index))
            if self.global_step == args.stall_at_step:
                time.sleep(args.stall_seconds)
        self.current = index.tolist()
        if self.global_step == args.mark_step:
            (out / f"at-step-{args.mark_step}-rank{self.global_rank}").touch()
        time.sleep(args.step_seconds)
        if self.trainer.is_global_zero and self.global_step == args.await_replacement_at:
            # until the new process asked to join (at the end of its set-up): it is dealt a share at the next boundary
            membership = self.trainer.strategy.rank_loss.membership
            deadline = time.monotonic() + 60
            while not set(membership.candidates()) - set(membership.members):
                assert time.monotonic() < deadline, "no new process asked to join within 60 s"
                time.sleep(0.05)
        if args.leave and self.global_rank == args.leave[0] and self.global_step == args.leave[1]:
            if args.leave_by == "signal":
                os.kill(os.getpid(), signal.SIGUSR2)
            else:
                self.trainer.strategy.leave()
        if args.refuse_leave and self.global_rank == args.refuse_leave[0] and self.global_step == args.refuse_leave[1]:
            try:
                self.trainer.strategy.leave()
            except Exception as refused:  # noqa: BLE001 - recorded for the test
                (out / f"leave-refused-rank{self.global_rank}.txt").write_text(f"{type(refused).__name__}: {refused}")
        later = args.lose_later or (None, None)
        dying = (args.lose_rank, later[0], args.lose_while_joining)
        if (args.record_seen or self.global_rank in dying) and not REPLACEMENT:
            with open(out / f"seen-rank{self.global_rank}.txt", "a") as seen:  # what it trained, up to its death
                seen.write(f"{self.global_step} {' '.join(map(str, self.current))}\n")
        if self.global_rank == later[0] and self.global_step == later[1]:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.global_rank == args.lose_while_joining and not REPLACEMENT:
            if getattr(self.trainer.strategy, "rank_loss", None) and self.trainer.strategy.rank_loss.pending_joins:
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
        if args.lose_rank is not None and self.global_rank == args.lose_rank and not REPLACEMENT:
            if self.global_step == args.lose_at_step and not (args.lose_after_backward or args.lose_in_pull):
                time.sleep(0.3)  # the others are past every sync point before this one (they wait in the next)
                os.kill(os.getpid(), signal.SIGKILL)
        if args.lose_server and args.lose_server_when == "flight" and self.global_rank == 0:
            if self.global_step in server_losses:
                kill_server(server_losses[self.global_step])
                time.sleep(0.3)
        if self.global_rank == 0 and self.global_step in server_returns:
            start_server_again(server_returns[self.global_step])
        if self.global_rank == 0 and args.await_server_return and self.global_step == args.await_server_return[1]:
            await_claim(args.await_server_return[0])
        loss = nn.functional.mse_loss(self.net(x), y)
        if args.collectives:
            self.log("train_loss", loss, sync_dist=True)
            self.gathered.append(sorted(self.all_gather(torch.tensor(self.global_rank)).tolist()))
            self.world_sizes.append(self.trainer.world_size)
        return loss

    def on_train_start(self):
        strategy = self.trainer.strategy
        if args.measure_exchange:  # its gradients are nobody's step, and it leaves nothing for the first step
            strategy.measure_exchange_seconds()
        if args.lose_server and args.lose_server_when == "pull" and self.global_rank == 0:
            from lightning_dp.comm.servers.transport import RegroupingServerTransport

            control = RegroupingServerTransport.control

            def control_then_kill(transport, kind, *a, **k):
                """--lose-server dies once the step's request of --lose-server's step went to every server (on
                every transport of this process: a regroup replaces it)."""
                control(transport, kind, *a, **k)
                server = server_losses.get(self.trainer.global_step)
                if kind == 1 and server is not None and not (out / f"server-lost-{server}").exists():
                    kill_server(server)  # (Control.STEP)

            RegroupingServerTransport.control = control_then_kill
        if args.lose_in_pull and self.global_rank == args.lose_rank and args.num_servers:
            transport = strategy.engine.transport
            receive = transport.share_weights_all

            def dying_receive(*a, **k):
                """The dedicated servers' pull of --lose-at-step: this rank dies before it receives the weights."""
                if self.trainer.global_step == args.lose_at_step:
                    (out / "lost").touch()
                    time.sleep(0.2)  # the servers have stepped and are sending
                    os.kill(os.getpid(), signal.SIGKILL)
                return receive(*a, **k)

            transport.share_weights_all = dying_receive
        elif args.lose_in_pull and self.global_rank == args.lose_rank:
            pull = strategy.engine.weights
            exchange = pull.exchange

            def dying(bucket):
                """The servers' pull of --lose-at-step: this rank dies before it sends its shard's new weights."""
                if self.trainer.global_step == args.lose_at_step:
                    (out / "lost").touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                exchange(bucket)

            pull.exchange = dying
        if self.global_rank != args.slow_commit_rank:
            return
        finish = strategy.reducer.finish

        def finish_late(*a, **k):
            """The exchange of --lose-at-step completes here, but its commit waits until the lost rank has died."""
            finish(*a, **k)
            if strategy.rank_loss.committed == args.lose_at_step:
                deadline = time.monotonic() + 10
                while not (out / "lost").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.5)

        strategy.reducer.finish = finish_late

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_ends.append(time.time())
        self.trained.append(self.current)
        self.current = None
        weights = torch.cat([p.detach().flatten() for p in self.parameters()])
        self.history.append((self.current_epoch, batch_idx, weights))
        late = getattr(self.trainer.strategy, "late_gradients", 0)
        self.late.append(late > self.late_so_far)
        self.late_so_far = late
        if attempt() == 0 and args.kill_at_step == self.global_step and self.global_rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt() == 0 and args.pause_at_step == self.global_step:
            (out / f"paused-rank{self.global_rank}").touch()
            while True:  # until the cluster stops the job (a requeue)
                time.sleep(1)

    def configure_optimizers(self):
        if REPLACEMENT:
            (out / "replacement-set-up").touch()
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if args.lr_every_step:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)]

    def train_dataloader(self):
        # shuffle=True: Lightning replaces the sampler with its DistributedSampler(shuffle=True)
        started_for = int(os.environ.get("WORLD_SIZE", self.trainer.world_size))
        size = args.batch_size if args.global_batch is None else args.global_batch // started_for
        return DataLoader(IndexedData(args.samples), batch_size=size, shuffle=True, num_workers=args.workers)


class ReadGradients(L.Callback):
    """--read-gradients: records the averaged gradients' norm before each optimizer step (before clipping)."""

    reads_weights = False

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.cat(grads).norm()) if grads else 0.0)


def kill_server(server: int) -> None:
    """SIGKILL dedicated server ``server`` (a child of trainer 0), or SIGSTOP it (--silent-server)."""
    process = trainer.strategy.engine.processes[server]
    if args.silent_server:
        os.kill(process.pid, signal.SIGSTOP)
    else:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    (out / f"server-lost-{server}").touch()


def start_server_again(server: int) -> None:
    """Start ``python -m lightning_dp.server`` for the lost dedicated ``server`` as a user would (the trainers'
    MASTER_ADDR and MASTER_PORT, no job scope), and wait until it claimed the server's place in the run's store and
    the leader (this process) saw the claim: the change that lets it in comes before any later step's loss."""
    command = [sys.executable, "-m", "lightning_dp.server", "--master-addr", os.environ["MASTER_ADDR"],
               "--master-port", os.environ["MASTER_PORT"], "--server-index", str(server), "--num-servers",
               str(args.num_servers), "--timeout", "60"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    started_again.append(subprocess.Popen(command, env=env))  # noqa: S603 - our own module
    engine = trainer.strategy.engine
    if args.kill_returning_server:
        report = engine._report_returned

        def killed_first(*report_args):  # (the trainers formed the member group with it: it takes its shares back)
            process = started_again[-1]
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            return report(*report_args)

        engine._report_returned = killed_first
    await_claim(server)


def await_claim(server: int) -> None:
    """Wait until the lost dedicated ``server``'s new process claimed its place in the run's store and the leader (this
    process) saw the claim (the change that lets it in comes at the next step boundary), or it serves already."""
    from lightning_dp.comm.servers.regroup import returning_address

    engine = trainer.strategy.engine
    deadline = time.monotonic() + 60
    while server not in engine.servers and (returning_address(engine._run_store, server) is None
                                            or server not in engine._returning):  # fmt: skip
        assert time.monotonic() < deadline, f"server {server} started again was not seen within 60 s"
        time.sleep(0.1)


class LoseServerAfterBackward(L.Callback):
    """--lose-server dies after trainer 0's backward of its step: every server summed the step's gradients."""

    reads_gradients = False
    reads_weights = False

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_rank == 0 and trainer.global_step in server_losses:
            kill_server(server_losses[trainer.global_step])


class LoseAfterBackward(L.Callback):
    """--lose-rank dies after its backward of --lose-at-step: that step's exchange is complete on every rank."""

    reads_gradients = False
    reads_weights = False

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_rank == args.lose_rank and trainer.global_step == args.lose_at_step:
            (out / "lost").touch()
            os.kill(os.getpid(), signal.SIGKILL)


class ValidatedModel(Model):
    """The model validated each epoch (--validate), its loss logged with sync_dist, the samples it evaluated counted
    by a torchmetrics metric (synced over the ranks at the epoch's end); validated once more after the fit."""

    def __init__(self) -> None:
        super().__init__()
        self.val_count = torchmetrics.SumMetric()

    def validation_step(self, batch, batch_idx):
        index, x, y = batch
        if not self.trainer.sanity_checking and self.trainer.state.fn == "fit":
            self.validated.append((self.current_epoch, index.tolist()))
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)
        self.val_count.update(len(index))
        self.log("val_count", self.val_count)

    def val_dataloader(self):
        return DataLoader(IndexedData(args.samples), batch_size=args.batch_size)


def attempt() -> int:
    """Which start of the job this is: 0 the first, then torchrun's restarts or SLURM's requeues."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or 0)


class VariablesEnvironment(ClusterEnvironment):
    """A cluster that starts every rank itself and tells it its place in environment variables."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    def set_world_size(self, size: int) -> None:
        pass  # the cluster's value stands

    def global_rank(self) -> int:
        return int(os.environ["RANK"])

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])

    def node_rank(self) -> int:
        return int(os.environ["NODE_RANK"])


def newest_checkpoint() -> str | None:
    found = [(int(m.group(1)), p) for p in (out / "ckpt").glob("*.ckpt") if (m := re.search(r"step=(\d+)", p.name))]
    return str(max(found)[1]) if found else None


resume = newest_checkpoint() if args.resume_from == "newest" else args.resume_from
options = {
    "balance": args.balance,
    "balance_interval": args.balance_interval,
    "backup_workers": args.backup_workers,
    "on_rank_loss": args.on_rank_loss,
    "intra_node": args.intra_node,
    "heartbeat_timeout": args.heartbeat_timeout,
    "num_servers": args.num_servers,
    "compression": args.compression,
    "restart_lost_ranks": args.restart_lost_ranks,
    "max_ranks": args.max_ranks,
    "restart_lost_servers": args.restart_lost_servers,
}
options = {k: v for k, v in options.items() if v is not None}
if args.external_servers:
    options["start_servers"] = False


def make_strategy():
    if not options:
        return args.strategy
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[args.strategy]
    return entry["strategy"](**{**entry["init_params"], **options})


def die_in_handover() -> None:
    """--kill-in-handover: that rank's process (the replacement's, if it is the rank replaced) dies as it enters the
    handover of the job's state to a new process."""
    rank = int(os.environ.get("NODE_RANK", 0)) * int(args.devices if args.devices != "auto" else 1) + int(
        os.environ.get("LOCAL_RANK", 0)
    )
    if args.kill_in_handover is None or rank != args.kill_in_handover:
        return
    if args.kill_in_handover == args.lose_rank and not REPLACEMENT:
        return
    from lightning_dp.strategies import rank_loss

    def dying(*a, **k):
        (out / f"killed-in-handover-{args.kill_in_handover}").touch()
        os.kill(os.getpid(), signal.SIGKILL)

    rank_loss.hand_over = dying


die_in_handover()
strategy = make_strategy()
model = ValidatedModel() if args.validate else Model()
monitor = CommMonitor(print_summary=False) if args.backup_workers or args.on_rank_loss else None
trainer = L.Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=args.devices if args.devices == "auto" else int(args.devices),
    num_nodes=args.num_nodes,
    max_epochs=args.max_epochs,
    accumulate_grad_batches=args.accumulate,
    gradient_clip_val=args.clip_norm,
    logger=False,
    callbacks=[
        ModelCheckpoint(out / "ckpt", every_n_train_steps=args.checkpoint_every, save_top_k=-1, filename="{step}"),
        *([monitor] if monitor is not None else []),
        *([LoseAfterBackward()] if args.lose_after_backward else []),
        *([LoseServerAfterBackward()] if args.lose_server and args.lose_server_when == "exchange" else []),
        *([ReadGradients()] if args.read_gradients else []),
    ],  # fmt: skip
    enable_progress_bar=False,
    enable_model_summary=False,
    plugins=[VariablesEnvironment()] if args.variables_environment else None,
)
try:
    trainer.fit(model, ckpt_path=resume)
except SystemExit as ended:  # --leave: the rank left the job; what it trained is kept, and it ends as it was told
    if ended.code != 0 or not args.leave:
        raise
    torch.save({"trained": model.trained, "history": model.history, "global_step": trainer.global_step,
                "rank_loss": trainer.strategy.rank_loss.metrics(), "world_size": trainer.world_size},
               out / f"rank{trainer.global_rank}.pt")  # fmt: skip
    raise
returned_codes = [process.wait(30) for process in started_again]  # (stopped by trainer 0 at the fit's end, or killed)
if args.lose_after_fit and trainer.global_rank == args.lose_rank:  # between two stages of the job
    time.sleep(1.0)  # the others are in the next stage's first collectives by now
    os.kill(os.getpid(), signal.SIGKILL)
counted = [float(trainer.callback_metrics.get("val_count", float("nan")))]
if args.validate:  # a later stage of the same job
    counted.append(float(trainer.validate(model, verbose=False)[0]["val_count"]))
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
balancer = getattr(getattr(trainer.strategy, "batches", None), "balancer", None)
decisions = balancer.state_dict()["decisions"] if balancer is not None else None
server = getattr(getattr(trainer.strategy, "engine", None), "server", None)
replica = getattr(getattr(trainer.strategy, "engine", None), "replica", None)
# the replicated servers' state: this rank's shard and its replica of its predecessor's (the layout's group ranks)
shards = None if replica is None else {
    "members": trainer.strategy.engine.layout_members, "owner": replica.owner,
    "own": [s.local_state() for s in trainer.strategy.engine.sharded_optimizers],
    "replica": [replica.local_state(k) for k in range(len(trainer.strategy.engine.sharded_optimizers))],
}  # fmt: skip
torch.save({"weights": weights, "trained": model.trained, "history": model.history, "resumed_from": resume,
            "decisions": decisions, "late": model.late, "dropped_by_server": getattr(server, "dropped", None),
            "skipped": getattr(trainer.strategy, "skipped_steps", 0), "global_step": trainer.global_step,
            "monitor": (monitor.summary.late_gradients, monitor.summary.skipped_steps) if monitor else None,
            "monitor_table": monitor.summary.table() if monitor else None,
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if "late" in k or "skipped" in k},
            "rank_loss": trainer.strategy.rank_loss.metrics() if hasattr(trainer.strategy, "rank_loss") else None,
            "codec": getattr(trainer.strategy, "codec", None).__class__.__name__,
            "world_size": trainer.world_size, "gathered": model.gathered, "world_sizes": model.world_sizes,
            "validated": model.validated, "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
            "val_counted": counted, "step_ends": model.step_ends, "returned_codes": returned_codes,
            "server_codes": getattr(getattr(trainer.strategy, "engine", None), "exit_codes", None),
            "full_gradients": getattr(trainer.strategy, "full_gradients", None),
            "final_states": getattr(getattr(trainer.strategy, "engine", None), "final_states", None), "shards": shards,
            "gradient_norms": next((c.norms for c in trainer.callbacks if isinstance(c, ReadGradients)), None)},
           out / f"rank{trainer.global_rank}.pt")  # fmt: skip
if args.refit_epochs:
    first = len(model.trained)
    again = L.Trainer(strategy=make_strategy(), accelerator="cpu", num_nodes=args.num_nodes,
                      devices=args.devices if args.devices == "auto" else int(args.devices),
                      max_epochs=args.refit_epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    again.fit(model)
    torch.save(
        {
            "trained": model.trained[first:],
            "world_size": again.world_size,
            "global_step": again.global_step,
            "rank_loss": again.strategy.rank_loss.metrics(),
        },
        out / f"refit-rank{again.global_rank}.pt",
    )
