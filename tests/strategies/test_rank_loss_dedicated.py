"""``on_rank_loss="continue"`` with dedicated servers (``num_servers > 0``): a trainer lost at any point of a step
(in flight, after its exchange, in the weight pull) takes no state with it (the servers hold every share), and a
server lost at any of those points leaves its share to its replica on a neighbour. The run goes on, and from each
loss on every step is one process's step on the samples trained, the trainers' weights bit-identical, the optimizer
state of the last checkpoint the one process's, and each server stepped once per step."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_dp.comm.servers.regroup import Regroup, RegroupListener, tell_server
from tests.helpers.distributed import free_port
from tests.helpers.launch import run_script, subprocess_env
from tests.helpers.midepoch import read_seen, replay, replay_loss
from tests.helpers.replicas import close

DEVICES, BATCH, SAMPLES, EPOCHS, LOST_AT, SERVER_LOST_AT, SECOND_SERVER_LOST_AT, CLIP = 3, 4, 72, 2, 4, 7, 10, 0.05
STEPS = EPOCHS * SAMPLES // (DEVICES * BATCH)
#: (strategy, where): (lost trainer, lost servers, clipping by norm, options). Two dedicated servers (three where two
#: are lost); trainer 0 (it started them) SIGKILLs one at step SERVER_LOST_AT (and another at SECOND_SERVER_LOST_AT),
#: after a trainer died at step LOST_AT, all at the same point:
#: - "in flight": trainer 2 dies in its training step: no trainer completes the exchange, which the servers sum
#:   again over the two survivors' gradients (that step trains without trainer 2's samples); no clipping, so that a
#:   server averaging over the trainers it started with fails the test. Then server 1 of three, in the training step:
#:   the exchange runs again, server 2 serving server 1's share from its replica; the replicas the loss left missing
#:   are made again (shares 1 and 2 on server 0, share 0 on server 2), so that server 2's loss later is survived
#:   too, server 0 serving everything from its new replicas. Every trainer times a synchronization as training
#:   starts (the servers' replies to it must not be taken for the first step's);
#: - "after the exchange": trainer 1 dies after backward, once both servers summed every trainer's gradients: the
#:   step closes with its samples (clipped by the global norm over the servers' shares). Then server 1 of three falls
#:   silent after backward (SIGSTOPped: its connections stay open, as a host cut off leaves them), found by the
#:   leader's probe within a heartbeat: server 2 holds its sums in the replica and answers the vote for both shares
#:   (it may have answered for its own before: a vote kept from then fails); the replicas made again after it take
#:   the sums of that step's exchange with them (shares 1 and 2 on server 0, stepped by that step's request). Server 2
#:   falls silent the same way three steps later, server 0 serving everything from those replicas;
#: - "in the pull" (``parameter_server``, the buckets cut over its three servers): trainer 2 dies as its weight pull
#:   starts, the servers having stepped: the pull runs again over the survivors, the servers sending their weights
#:   without stepping twice; the training step logs with sync_dist and all-gathers, over the survivors from the next
#:   step on. Then server 1, once the step's request went to every server: server 2 (which may have stepped the
#:   replica already) does not step it again, and the replicas made again on server 0 carry the step keys with them
#:   (a replica stepped twice fails when server 2 is lost the same way three steps later).
SCENARIOS = {
    ("sharded_ps", "in flight"): (2, (1, 2), None, ("--intra-node", "ring", "--measure-exchange")),
    ("sharded_ps", "after the exchange"): (1, (1, 2), CLIP, ("--intra-node", "ring", "--lose-after-backward",
                                                          "--lose-server-when", "exchange", "--silent-server")),
    ("parameter_server", "in the pull"): (2, (1, 2), CLIP, ("--lose-in-pull", "--collectives", "--lose-server-when",
                                                              "pull")),
}  # fmt: skip
#: (exchanges committed with the lost trainer, exchanges run again: over the trainers, then over the servers left)
EXPECTED = {"in flight": (LOST_AT, 3), "after the exchange": (LOST_AT + 1, 0), "in the pull": (LOST_AT + 1, 0)}
#: the survivors among the servers: (server, replicas it made again)
SERVERS_LEFT = {"in flight": [(0, 2)], "after the exchange": [(0, 2)], "in the pull": [(0, 2)]}


@dataclass
class Run:
    where: str
    lost: int
    servers: tuple[int, ...]
    clip: float | None
    out: Path
    output: str
    survivors: list[dict]
    seen: dict[int, list[int]]


_runs: dict[tuple[str, str], Run] = {}


def _launch(key: tuple[str, str], tmp_path_factory) -> Run:
    """The scenario's job, run once per session."""
    if key not in _runs:
        strategy, where = key
        lost, servers, clip, options = SCENARIOS[key]
        out = tmp_path_factory.mktemp("dedicated-loss")
        clipping = ("--clip-norm", str(clip)) if clip is not None else ()
        steps = (SERVER_LOST_AT, SECOND_SERVER_LOST_AT)[: len(servers)]
        server_losses = [x for pair in zip(servers, steps, strict=True) for x in ("--lose-server", *map(str, pair))]
        result = run_script(
            "midepoch", "--strategy", strategy, "--devices", str(DEVICES), "--num-servers", str(1 + len(servers)),
            "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss",
            "continue", "--heartbeat-timeout", "2", "--lose-rank", str(lost), "--lose-at-step", str(LOST_AT),
            *server_losses, *clipping, *options, "--out", str(out), timeout=180,
        )  # fmt: skip
        survivors = [torch.load(out / f"rank{r}.pt") for r in range(DEVICES) if r != lost]
        seen = read_seen(out / f"seen-rank{lost}.txt")
        _runs[key] = Run(where, lost, servers, clip, out, result.stdout, survivors, seen)
    return _runs[key]


@pytest.fixture(scope="module", params=sorted(SCENARIOS), ids=[" ".join(key) for key in sorted(SCENARIOS)])
def losses(request, tmp_path_factory) -> Run:
    return _launch(request.param, tmp_path_factory)


@pytest.mark.multiprocess
def test_the_servers_go_on_with_the_survivors_and_without_the_lost_server(losses):
    with_lost, redone = EXPECTED[losses.where]
    for s in losses.survivors:
        metrics = s["rank_loss"]
        assert metrics["lost_ranks"] == [losses.lost] and metrics["loss_causes"] == ["closed"], metrics
        assert metrics["loss_steps"] == [with_lost] and metrics["redone_steps"] == redone, metrics
        assert metrics["lost_servers"] == list(losses.servers), metrics
        assert len(s["history"]) == s["global_step"] == STEPS
    assert all(seconds < 5.0 for seconds in losses.survivors[0]["rank_loss"]["server_recovery_seconds"])
    # the servers left stepped once per step, regrouped after each loss, and made the replicas a loss left missing
    if losses.where == "after the exchange":  # silent, not closed: the leader's probe found them
        for server in losses.servers:
            assert f"dedicated server {server} did not answer a probe within 2.0 s" in losses.output, losses.output
    for server, made in SERVERS_LEFT[losses.where]:
        done = f"server {server} done after {STEPS} steps and {1 + len(losses.servers)} regroups"
        assert done + (f", {made} replicas made again" if made else "\n") in losses.output, losses.output
    assert "did not stop cleanly" not in losses.output


@pytest.mark.multiprocess
def test_every_step_equals_one_process_and_the_state_lost_nothing(losses):
    """A planted replica that is never stepped, or a server averaging over the trainers it started with, fails."""
    survivors = losses.survivors
    momenta: list[torch.Tensor] = []
    reference = replay_loss(survivors, losses.seen, SAMPLES, clip_norm=losses.clip, momenta=momenta)
    assert len(reference) == len(survivors[0]["history"]) == STEPS
    for j, want in enumerate(reference):
        got = survivors[0]["history"][j][2]
        for other in survivors[1:]:
            assert torch.equal(got, other["history"][j][2]), f"the trainers' weights differ after batch {j}"
        close(got, want, f"after batch {j}")
    saved = torch.load(losses.out / "ckpt" / f"step={STEPS}.ckpt", weights_only=False)
    for where, state in [("the last checkpoint", saved["optimizer_states"][0]["state"])] + [
        (f"a survivor's final states ({i})", s["final_states"][0]["state"]) for i, s in enumerate(survivors)
    ]:  # (every trainer keeps the final states the leader gathered: another may write a later checkpoint)
        buffers = torch.cat([state[k]["momentum_buffer"].flatten() for k in sorted(state)])
        close(buffers, momenta[-1], f"the momentum buffers of {where}")


@pytest.mark.multiprocess
def test_collectives_run_over_the_survivors(tmp_path_factory):
    run = _launch(("parameter_server", "in the pull"), tmp_path_factory)
    everyone, left = list(range(DEVICES)), [r for r in range(DEVICES) if r != run.lost]
    for s in run.survivors:
        assert s["gathered"] == [everyone if j <= LOST_AT else left for j in range(STEPS)]  # (lost after its step 4)


def _message(generation: int, token: str = "run") -> Regroup:
    return Regroup(generation, 2, (0, 1), ((0,), (1,)), ("127.0.0.1", 1), "prefix", token)


@pytest.mark.unit
def test_a_server_follows_only_this_runs_newer_regroup_messages():
    """The listener refuses another run's token and a stray connection; the server keeps only a newer
    generation than it has (a planted listener that takes any token fails the first assertion)."""
    taken: list[Regroup] = []
    listener = RegroupListener("127.0.0.1", "run", taken.append)
    try:
        with pytest.raises(ConnectionError, match="refused"):
            tell_server(listener.address, _message(1, token="another run"), timeout=5)
        with socket.create_connection(listener.address, timeout=5) as stray:  # garbage, then closed
            stray.sendall(b"\x00\x00\x00\x05hello")
        tell_server(listener.address, _message(1), timeout=5)
        assert taken == [_message(1)]
    finally:
        listener.close()


@pytest.mark.unit
def test_the_newest_regroup_wins():
    from lightning_dp.comm.servers.regroup import RegroupingServer

    server = RegroupingServer.__new__(RegroupingServer)  # the regroup bookkeeping alone, without a member group
    server.generation, server._pending, server._connections = 1, None, []
    server._regroup_cond = threading.Condition()
    server.on_regroup(_message(1))  # the generation it has
    assert server._pending is None
    server.on_regroup(_message(3))
    server.on_regroup(_message(2))  # older than the one pending
    assert server._pending == _message(3)


@pytest.mark.unit
def test_a_server_whose_member_group_fails_fences_it_at_once():
    """A server waiting for the leader's regroup message first fences its failed member group: a trainer still waiting
    on it sees the connection end now, not at its timeout (a planted regroup that fences only on the message fails)."""
    from lightning_dp.comm.membership.fence import connections_opened_by
    from lightning_dp.comm.servers.regroup import RegroupingServer

    with socket.create_server(("127.0.0.1", 0)) as listener:
        trainer = socket.create_connection(listener.getsockname())
        server_end, connections = connections_opened_by(lambda: listener.accept()[0])  # (the server's end only)
    server = RegroupingServer.__new__(RegroupingServer)  # the regroup's wait alone, without a member group
    server._pending, server._connections, server.rejoin_timeout = None, connections, 0.5
    server._regroup_cond = threading.Condition()
    try:
        trainer.settimeout(5.0)
        with pytest.raises(RuntimeError, match="no trainer said within"):
            server._regroup(ConnectionError("a member was lost"))
        assert trainer.recv(1) == b""  # ended by the server's fence (a wait would have timed out instead)
    finally:
        trainer.close()
        server_end.close()


@pytest.mark.multiprocess
def test_servers_started_apart_outlive_global_rank_0(tmp_path):
    """One trainer per node (Lightning's general cluster environment), two servers started with ``python -m
    lightning_dp.server``: global rank 0 (the store the servers joined on, checkpoints, logging) dies in its training
    step; the servers go on with the two survivors, and every step equals one process on the samples trained."""
    port = free_port()
    servers = [subprocess.Popen([sys.executable, "-m", "lightning_dp.server", "--master-addr", "127.0.0.1",
                                 "--master-port", str(port), "--server-index", str(i), "--num-servers", "2",
                                 "--timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=subprocess_env())
               for i in range(2)]  # fmt: skip
    try:
        result = run_script(
            "midepoch", "--strategy", "sharded_ps", "--devices", "1", "--num-nodes", str(DEVICES), "--num-servers",
            "2", "--external-servers", "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs",
            str(EPOCHS), "--on-rank-loss", "continue", "--heartbeat-timeout", "2", "--lose-rank", "0",
            "--lose-at-step", str(LOST_AT), "--clip-norm", str(CLIP), "--out", str(tmp_path), timeout=180,
            check=False, deaths_expected=True, env={"LIGHTNING_DP_TEST_NODES": str(DEVICES)}, port=port,
        )  # fmt: skip
        outputs = [server.communicate(timeout=60)[0] for server in servers]
    finally:
        for server in servers:
            server.kill()
    assert result.codes == [-9, 0, 0], result.stdout[-5000:]
    for i, (server, output) in enumerate(zip(servers, outputs, strict=True)):
        assert server.returncode == 0, output[-3000:]
        assert f"server {i} done after {STEPS} steps and 1 regroups" in output, output[-3000:]
    survivors = [torch.load(tmp_path / f"rank{r}.pt") for r in (1, 2)]
    assert all(s["rank_loss"]["lost_ranks"] == [0] and s["rank_loss"]["redone_steps"] == 1 for s in survivors)
    reference = replay_loss(survivors, read_seen(tmp_path / "seen-rank0.txt"), SAMPLES, clip_norm=CLIP)
    assert len(reference) == len(survivors[0]["history"]) == STEPS
    for j, want in enumerate(reference):
        assert torch.equal(survivors[0]["history"][j][2], survivors[1]["history"][j][2]), f"after batch {j}"
        close(survivors[0]["history"][j][2], want, f"after batch {j}")


@pytest.mark.multiprocess
def test_a_callback_reading_the_averaged_gradients_is_refused_at_set_up(tmp_path):
    """The servers do not send the averaged gradients back under on_rank_loss='continue': a run whose callback reads
    them stops at set-up with an error naming the reader, before any step."""
    result = run_script(
        "midepoch", "--strategy", "parameter_server", "--devices", "2", "--num-servers", "1", "--samples", "16",
        "--on-rank-loss", "continue", "--read-gradients", "--out", str(tmp_path), timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "cannot send the averaged gradients back to the trainers, which ReadGradients" in result.stdout
    assert not list(tmp_path.glob("ckpt/*.ckpt"))


@pytest.mark.multiprocess
def test_a_lost_server_without_a_replica_stops_every_trainer_naming_it(tmp_path):
    """One server (parameter_server, num_servers=1) has no neighbour to hold its replica: its loss stops every
    trainer with ReplicaLostError naming it, within the test's timeout (no hang)."""
    result = run_script(
        "midepoch", "--strategy", "parameter_server", "--devices", str(DEVICES), "--num-servers", "1", "--samples",
        str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss", "continue",
        "--heartbeat-timeout", "2", "--lose-server", "0", str(LOST_AT), "--out", str(tmp_path), timeout=120,
        check=False,
    )  # fmt: skip
    assert all(code != 0 for code in result.codes), result.codes
    assert "ReplicaLostError: dedicated server 0 was lost with share 0" in result.stdout, result.stdout[-5000:]


RETURN_LOST_AT, RETURN_AT, OTHER_LOST_AT, RETURN_TRAINERS = 4, 7, 12, 2


@pytest.mark.multiprocess
def test_a_lost_server_started_again_serves_again_and_the_next_loss_is_survived(tmp_path):
    """``sharded_ps`` with two trainers and two dedicated servers: server 1 is SIGKILLed at step 4 (server 0 serves
    both shares from its replica); trainer 0 starts it again (``restart_lost_servers=1``), and the new process claims
    its place; the trainers let it in at a step boundary (trainer 0 waits at step 7 until it claimed it): it takes
    its share back from server 0, which keeps it as its replica, and receives server 0's to replicate. At step 12
    server 0 is SIGKILLed: server 1 serves both shares from that replica to the end. Every step equals one process on
    the global batch, the last checkpoint's optimizer state the one process's (a planted handover without the
    optimizer state fails it). A process started by hand: the next test."""
    steps = EPOCHS * SAMPLES // (RETURN_TRAINERS * BATCH)
    result = run_script(
        "midepoch", "--strategy", "sharded_ps", "--devices", str(RETURN_TRAINERS), "--num-servers", "2",
        "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss",
        "continue", "--heartbeat-timeout", "2", "--lose-server", "1", str(RETURN_LOST_AT), "--restart-lost-servers",
        "1", "--await-server-return", "1", str(RETURN_AT), "--lose-server", "0", str(OTHER_LOST_AT), "--clip-norm",
        str(CLIP), "--out", str(tmp_path), timeout=180,
    )  # fmt: skip
    trainers = [torch.load(tmp_path / f"rank{r}.pt") for r in range(RETURN_TRAINERS)]
    for t in trainers:
        metrics = t["rank_loss"]
        assert metrics["lost_ranks"] == [] and metrics["lost_servers"] == [1, 0], metrics
        assert metrics["returned_servers"] == [1] and len(metrics["server_return_seconds"]) == 1, metrics
        assert len(t["history"]) == t["global_step"] == steps
    assert "dedicated server 1 started again (restart_lost_servers: 0 left)" in result.stdout
    assert trainers[0]["server_codes"][1] == 0, trainers[0]["server_codes"]  # (the process started again, stopped)
    assert "server 1 joined the running job" in result.stdout, result.stdout[-5000:]
    done = re.search(r"server 1 done after (\d+) steps and 1 regroups, 1 replicas made again \(joined the running "
                     r"job, 1 shares taken back: \d+ bytes\)", result.stdout)  # fmt: skip
    assert done is not None and steps - RETURN_AT >= int(done.group(1)) >= steps - OTHER_LOST_AT, result.stdout[-5000:]
    assert "started again and serve again: server 1 takes back shares [1] from server 0" in result.stdout
    assert "did not stop cleanly" not in result.stdout
    batches = [[i for t in trainers for i in t["trained"][j]] for j in range(steps)]
    momenta: list[torch.Tensor] = []
    reference = replay(batches, trainers[0]["history"], SAMPLES, clip_norm=CLIP, momenta=momenta)
    assert len(reference) == steps
    for j, want in enumerate(reference):
        assert torch.equal(trainers[0]["history"][j][2], trainers[1]["history"][j][2]), f"after batch {j}"
        close(trainers[0]["history"][j][2], want, f"after batch {j}")
    state = torch.load(tmp_path / "ckpt" / f"step={steps}.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    close(torch.cat([state[k]["momentum_buffer"].flatten() for k in sorted(state)]), momenta[-1], "the momenta")


@pytest.mark.multiprocess
def test_a_server_started_again_and_lost_as_it_takes_its_share_back_leaves_the_job_going(tmp_path):
    """As above, but started by hand (``python -m lightning_dp.server`` with the trainers' ``MASTER_ADDR`` and
    ``MASTER_PORT``, no job scope) and SIGKILLed as the trainers let it in (it is taking its share back, or has just
    taken it): server 0, which handed the share over and kept its copy as the replica, serves both shares
    again, and the run goes on to the end, every step one process's on the global batch (planted: a leader that counts
    the share handed back as having no replica ends the run with ReplicaLostError)."""
    steps = EPOCHS * SAMPLES // (RETURN_TRAINERS * BATCH)
    result = run_script(
        "midepoch", "--strategy", "sharded_ps", "--devices", str(RETURN_TRAINERS), "--num-servers", "2",
        "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--max-epochs", str(EPOCHS), "--on-rank-loss",
        "continue", "--heartbeat-timeout", "2", "--lose-server", "1", str(RETURN_LOST_AT), "--replace-server", "1",
        str(RETURN_AT), "--kill-returning-server", "--clip-norm", str(CLIP), "--out", str(tmp_path), timeout=180,
    )  # fmt: skip
    trainers = [torch.load(tmp_path / f"rank{r}.pt") for r in range(RETURN_TRAINERS)]
    for t in trainers:
        metrics = t["rank_loss"]
        assert metrics["lost_ranks"] == [] and metrics["lost_servers"] == [1, 1], metrics
        assert metrics["returned_servers"] == [1], metrics
        assert len(t["history"]) == t["global_step"] == steps
    assert trainers[0]["returned_codes"] == [-9]
    assert f"server 0 done after {steps} steps and 3 regroups" in result.stdout, result.stdout[-5000:]
    batches = [[i for t in trainers for i in t["trained"][j]] for j in range(steps)]
    momenta: list[torch.Tensor] = []
    reference = replay(batches, trainers[0]["history"], SAMPLES, clip_norm=CLIP, momenta=momenta)
    for j, want in enumerate(reference):
        assert torch.equal(trainers[0]["history"][j][2], trainers[1]["history"][j][2]), f"after batch {j}"
        close(trainers[0]["history"][j][2], want, f"after batch {j}")
    state = torch.load(tmp_path / "ckpt" / f"step={steps}.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    close(torch.cat([state[k]["momentum_buffer"].flatten() for k in sorted(state)]), momenta[-1], "the momenta")
