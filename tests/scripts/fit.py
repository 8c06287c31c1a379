"""Train ``RegressionModel`` under a strategy and save what every rank saw (run by the tests as a subprocess)."""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch

import lightning_dp  # noqa: F401 - registers the strategies
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
from lightning_dp.comm.cluster.sockets import tcp_sockets
from tests.scripts import placement
from tests.scripts.models import MODELS, flat_weights

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="ring_allreduce")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--batchnorm", action="store_true")
parser.add_argument("--no-broadcast-buffers", action="store_true")
parser.add_argument("--num-nodes", type=int, default=1)
parser.add_argument("--clip", choices=["norm", "value"], default=None)
parser.add_argument("--clip-val", type=float, default=0.05)
parser.add_argument("--server-rank", type=int, default=None)
parser.add_argument("--num-servers", type=int, default=None, help="strategy option: dedicated server processes")
parser.add_argument("--external-servers", action="store_true", help="start_servers=False: started by the CLI elsewhere")
parser.add_argument("--timeout", type=float, default=None, help="seconds a peer may stay silent (strategy option)")
parser.add_argument("--intra-node", choices=["shm", "ring"], default=None, help="strategy option")
parser.add_argument("--shm-wait", default=None, help="strategy option")
parser.add_argument("--bucket-cap-mb", type=float, default=None, help="strategy option")
parser.add_argument("--compression", default=None, help="strategy option")
parser.add_argument("--powersgd-rank", type=int, default=None, help="strategy option")
parser.add_argument("--powersgd-warmup", type=int, default=None, help="strategy option powersgd_warmup_steps")
parser.add_argument("--staleness", default=None, help="strategy option: an integer, or 'none' (asynchronous)")
parser.add_argument("--slow-rank", type=int, default=None, help="this rank sleeps --slow-seconds before each step")
parser.add_argument("--slow-seconds", type=float, default=0.0)
parser.add_argument("--kill-rank", type=int, default=None, help="this rank SIGKILLs itself before step --kill-step")
parser.add_argument("--kill-step", type=int, default=0)
parser.add_argument("--kill-server-step", type=int, default=None, help="rank 0 SIGKILLs server 0 before this step")
parser.add_argument("--sigterm-rank", type=int, default=None, help="this rank gets SIGTERM before step --kill-step")
parser.add_argument("--mark-step", type=int, default=None, help="each rank touches <out>/at-step-<step>-rank<r> then")
parser.add_argument("--model", choices=sorted(MODELS), default="regression")
parser.add_argument("--out", required=True)
args = parser.parse_args()
if args.staleness is not None:
    args.staleness = None if args.staleness == "none" else int(args.staleness)

options = {"broadcast_buffers": False} if args.no_broadcast_buffers else {}
options.update(placement.backend_options())
# strategy options given on the command line: argument name -> option name
for arg, option in (("server_rank", "server_rank"), ("num_servers", "num_servers"), ("timeout", "timeout"),
                    ("intra_node", "intra_node"), ("shm_wait", "shm_wait"), ("bucket_cap_mb", "bucket_cap_mb"),
                    ("compression", "compression"), ("powersgd_rank", "powersgd_rank"),
                    ("powersgd_warmup", "powersgd_warmup_steps")):  # fmt: skip
    if getattr(args, arg) is not None:
        options[option] = getattr(args, arg)
if "--staleness" in sys.argv:
    options["staleness"] = args.staleness
if args.external_servers:
    options["start_servers"] = False
strategy = args.strategy
if options:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[strategy]
    strategy = entry["strategy"](**{**entry["init_params"], **options})


class Record(L.Callback):
    reads_weights = False  # its hooks between steps read no weights: the servers' pull stays behind the forward

    def on_train_start(self, trainer, pl_module):
        self.sockets = tcp_sockets()
        #: per backward: how many buckets had been sent when the gradient backward produces last (the first
        #: layer's weight) was computed, while backward still ran
        self.sent_during_backward: list[int] = []
        reducer = getattr(trainer.strategy, "reducer", None)
        if reducer is not None:
            first = next(p for p in pl_module.parameters() if p.requires_grad)

            def record_sent(grad):
                self.sent_during_backward.append(sum(bucket.launched for bucket in reducer.buckets))

            first.register_hook(record_sent)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == args.slow_rank:
            time.sleep(args.slow_seconds)
        if trainer.global_rank == args.kill_rank and trainer.global_step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.global_rank == 0 and trainer.global_step == args.kill_server_step:
            os.kill(trainer.strategy.engine.processes[0].pid, signal.SIGKILL)
        if trainer.global_rank == args.sigterm_rank and trainer.global_step == args.kill_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if trainer.global_step == args.mark_step:
            Path(args.out, f"at-step-{args.mark_step}-rank{trainer.global_rank}").touch()

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy
        stats = getattr(s, "sync_stats", None)
        self.result = {
            "last_step_bytes": stats.last_step_bytes if stats is not None else None,
            "sync_bytes": stats.bucket_bytes if stats is not None else None,
            "buckets": len(s.reducer.buckets) if getattr(s, "reducer", None) is not None else None,
            "bucket_bytes": [[p.numel() * p.element_size() for p in b.params] for b in s.reducer.buckets]
            if getattr(s, "reducer", None) is not None
            else None,
            "sent_during_backward": self.sent_during_backward,
            "flag_bytes": sum(b.flags.numel() * b.flags.element_size() for b in s.reducer.buckets)
            if getattr(s, "reducer", None) is not None
            else None,
            "predicted_bytes": s.predicted_step_bytes() if hasattr(s, "predicted_step_bytes") else None,
            "optimizer_state_bytes": s.optimizer_state_bytes() if hasattr(s, "optimizer_state_bytes") else None,
            "sockets": self.sockets,
            "transport": type(s.transport).__name__ if hasattr(s, "transport") else None,
            "codec": s.codec.name if hasattr(s, "codec") else None,
            "staleness_seen": dict(s.staleness_seen.histogram) if hasattr(s, "staleness_seen") else None,
            "hierarchical": getattr(getattr(getattr(s, "transport", None), "_exchange", None), "cross_group", None)
            is not None,
            "spin_seconds": getattr(getattr(getattr(s, "transport", None), "_exchange", None), "memory", None)
            and s.transport._exchange.memory.spin_seconds,
        }


record = Record()

model = MODELS[args.model](args.batch_size, args.optimizer, **({"batchnorm": True} if args.batchnorm else {}))
trainer = L.Trainer(
    strategy=strategy,
    **placement.trainer_placement(args.devices, args.num_nodes),
    max_steps=args.steps,
    accumulate_grad_batches=args.accumulate,
    gradient_clip_val=args.clip_val if args.clip else None,
    gradient_clip_algorithm=args.clip,
    callbacks=[record],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=True,
)
trainer.fit(model)
os.makedirs(args.out, exist_ok=True)
torch.save(
    {
        "weights": model.history,
        "final": flat_weights(model),
        "buffers": model.buffer_history,
        "world_size": trainer.world_size,
        **record.result,
    },
    os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
)
