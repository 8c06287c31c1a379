"""A dedicated parameter server process: ``python -m lightning_dp.server``.

Joins a run of ``ParameterServerStrategy(num_servers=K)`` or ``ShardedParameterServerStrategy(num_servers=K)``
through the trainers' rendezvous (their ``MASTER_ADDR`` and ``MASTER_PORT``), serves its share of the weights
(:class:`~lightning_dp.comm.servers.DedicatedServer`) and exits when the run ends: 0 when trainer 0 stops it,
1 when the run failed or a trainer was lost (the message names it). On one machine the strategy starts its servers
itself; across machines start one per server on the CPU machines::

    python -m lightning_dp.server --master-addr HOST --master-port PORT --server-index I --num-servers K

With ``on_rank_loss="continue"`` the same command started again for a server the trainers lost joins the running
job: once the trainers took it for lost it waits (``--timeout``) for their leader to let it in, receives the state of
its shares from the server that served them meanwhile and serves again.

Needs no Lightning: the optimizer classes the trainers use must be importable here (``torch.optim`` ones are).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from lightning_dp.comm.cluster.rendezvous import die_with_parent, interface_with_address, local_address_towards
from lightning_dp.comm.errors import ForeignJobError
from lightning_dp.comm.membership.fence import connections_opened_by
from lightning_dp.comm.servers import DedicatedServer, MemberGroup, run_store
from lightning_dp.comm.servers.regroup import (
    RegroupingServer,
    RegroupListener,
    claim_return,
    join_running_job,
    listener_key,
    warm_up,
)

#: how long a server waits for the trainers' next message: without a deadline in practice (validation, checkpoint
#: writing and a slow epoch end all pause the trainers); a lost trainer's closed sockets end any wait at once
IDLE_TIMEOUT = timedelta(days=7)


def _log(message: str) -> None:
    print(f"[lightning_dp.server] {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_dp.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--master-addr", required=True, help="the trainers' MASTER_ADDR (trainer 0's host)")
    parser.add_argument("--master-port", required=True, type=int, help="the trainers' MASTER_PORT")
    parser.add_argument("--server-index", required=True, type=int, help="this server's index, in [0, num-servers)")
    parser.add_argument("--num-servers", required=True, type=int, help="the strategy's num_servers")
    parser.add_argument("--run-key", default="0", help="which fit of the trainers' process to join (0: the first)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the trainers to be there (started again for a lost server: also "
                        "for its loss to be noticed and for the trainers to let it in)")  # fmt: skip
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # local servers die with it
    parser.add_argument("--scope", default=None, help=argparse.SUPPRESS)  # local servers: the trainers' job scope
    return parser


def _exit_lost(name: str, error: BaseException) -> None:
    """A trainer was lost mid-run: the run cannot go on, and the serving loop may be waiting for trainer 0."""
    _log(f"{name} stops: {error}")
    os._exit(1)


def _rejoin(store: dist.Store, args: argparse.Namespace, num_servers: int) -> RegroupingServer:
    """A process started again for a lost server joins the running job (``on_rank_loss="continue"``: only there do
    servers write their listener, which says the server served before): it claims the server's place once the
    trainers took it for lost, and waits for their leader to let it in."""
    started = time.monotonic()
    plan = pickle.loads(store.get("plan"))  # noqa: S301 - written by trainer 0 of this run
    regroup = plan.extra["regroup"]
    warm_up(plan)
    index, rejoin = args.server_index, float(regroup["rejoin_timeout"])

    def claim(address: tuple[str, int]) -> None:
        claim_return(store, index, address, args.timeout)
        _log(f"server {index} (pid {os.getpid()}) started again: waiting for the trainers to let it in")

    server = join_running_job(plan, index, num_servers, local_address_towards(args.master_addr), regroup["token"],
                              claim, max(args.timeout, rejoin), rejoin, IDLE_TIMEOUT)  # fmt: skip
    _log(
        f"server {index} joined the running job in {time.monotonic() - started:.2f} s, at the trainers' "
        f"generation {server.generation}, serving shares {list(server.serving[index])}"
    )
    return server


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    if args.num_servers < 1:
        _log(f"--num-servers must be >= 1, got {args.num_servers}")
        return 2
    if not 0 <= args.server_index < args.num_servers:
        _log(f"--server-index must be in [0, {args.num_servers}) for --num-servers {args.num_servers}, "
             f"got {args.server_index}")  # fmt: skip
        return 2
    name = f"server {args.server_index}"
    try:
        interface = interface_with_address(local_address_towards(args.master_addr))
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        store = run_store(args.master_addr, args.master_port, args.run_key, timedelta(seconds=args.timeout),
                          scope=args.scope)  # fmt: skip
        num_trainers = int(store.get("num_trainers"))
        expected = int(store.get("num_servers"))
    except ForeignJobError as error:
        _log(f"{name}: {error}")
        return 2
    except Exception as error:  # noqa: BLE001 - any failure to reach the job is one clear message
        _log(f"{name}: found no lightning-dp job at {args.master_addr}:{args.master_port} within "
             f"{args.timeout:.0f} s (is the job running, with num_servers > 0, and are these its MASTER_ADDR and "
             f"MASTER_PORT?): {error}")  # fmt: skip
        return 2
    if expected != args.num_servers:
        _log(f"{name}: the job runs with num_servers={expected}, this server was started with --num-servers "
             f"{args.num_servers}")  # fmt: skip
        return 2
    try:
        server: DedicatedServer
        if store.check([listener_key(args.server_index)]):  # it served before: started again after its loss
            server = _rejoin(store, args, expected)
        else:
            members, connections = connections_opened_by(
                lambda: MemberGroup(store, num_trainers + args.server_index, num_trainers, expected, IDLE_TIMEOUT)
            )
            plan = pickle.loads(store.get("plan"))  # noqa: S301 - written by trainer 0 of this run
            regroup = plan.extra.get("regroup")
            if regroup is None:
                server = DedicatedServer(members, plan, on_lost=lambda error: _exit_lost(name, error))
            else:  # on_rank_loss="continue": it goes on with the trainers that survive a loss
                server = RegroupingServer(members, plan, connections, float(regroup["rejoin_timeout"]), IDLE_TIMEOUT)
                listener = RegroupListener(local_address_towards(args.master_addr), regroup["token"],
                                           server.on_regroup)  # fmt: skip
                store.set(listener_key(args.server_index), json.dumps(list(listener.address)))
            _log(f"{name} (pid {os.getpid()}) serves {server.layout.storage.numel()} elements for {num_trainers} "
                 "trainers")  # fmt: skip
        server.run()
    except Exception as error:  # noqa: BLE001 - the run failed: exit non-zero with the reason
        _log(f"{name} stops: {error}")
        return 1
    done = f"{name} done after {server.steps} steps"
    if isinstance(server, RegroupingServer) and server.regroups:
        done += f" and {server.regroups} regroups" + (f", {server.replicas_made} replicas made again"
                                                       if server.replicas_made else "")  # fmt: skip
    if isinstance(server, RegroupingServer) and server.shares_taken_back:
        done += (f" (joined the running job, {server.shares_taken_back} shares taken back: "
                 f"{server.bytes_taken_back} bytes)")  # fmt: skip
    _log(done)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # without running gloo's destructors under the receiving thread still waiting for the next step's gradients
    os._exit(code)
