"""The rendezvous binds narrowly: the store on the main address only, gloo on the interface towards it."""

import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm.cluster.rendezvous import interface_with_address, local_address_towards, resolve
from lightning_dp.comm.cluster.sockets import tcp_sockets
from tests.helpers.distributed import run_distributed


@pytest.mark.unit
def test_address_helpers_on_loopback():
    assert resolve("localhost") == "127.0.0.1" and resolve("127.0.0.1") == "127.0.0.1"
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("192.0.2.254") is None  # TEST-NET-1: on no interface here
    with pytest.raises(socket.gaierror):
        resolve("no-such-host.invalid")


def _sockets_after_training_traffic(rank, world_size):
    t = torch.full((1000,), float(rank))
    dist.all_reduce(t)
    group = dist.new_group()  # later groups use the same interface
    dist.all_reduce(t, group=group)
    return tcp_sockets(), t[0].item()


@pytest.mark.multiprocess
def test_store_and_gloo_listen_only_on_loopback():
    results = run_distributed(_sockets_after_training_traffic, 2, backend="gloo-bound", timeout=60)
    for rank, (sockets, value) in enumerate(results):
        assert value == 2 * (0 + 1)  # two all-reduces went through
        assert {s["address"] for s in sockets} == {"127.0.0.1"}, (rank, sockets)
        listening = sum(s["listening"] for s in sockets)
        assert listening >= (2 if rank == 0 else 1), (rank, sockets)  # gloo's listener(s), and on rank 0 the store


@pytest.mark.multiprocess
def test_a_later_run_in_the_same_process_reuses_the_port():
    """A Hydra sweep or a fixed cluster port: the next job joins on the port a still-alive store serves."""
    import subprocess
    import sys

    from tests.helpers.distributed import free_port

    code = f"""
from datetime import timedelta
import torch, torch.distributed as dist
from lightning_dp.comm.cluster.rendezvous import init_bound_process_group
kept = []
for job in range(2):
    init_bound_process_group("gloo", "127.0.0.1", {free_port()}, 0, 1, timedelta(seconds=20), single_host=True)
    kept.append(dist.new_group())  # held on to, as a finished Trainer's strategy holds its gradient group
    dist.all_reduce(torch.ones(1), group=kept[-1])
    dist.destroy_process_group()
print("two jobs joined")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "two jobs joined" in out.stdout, out.stderr[-3000:]


@pytest.mark.multiprocess
def test_the_groups_a_process_joined_are_closed_before_the_interpreter_finalizes():
    """gloo's worker threads let go of their last operations (taking the GIL) before the interpreter finalizes,
    which would otherwise abort a rank after a run that succeeded."""
    import subprocess
    import sys

    from tests.helpers.distributed import free_port

    code = f"""
import atexit
from datetime import timedelta
import torch, torch.distributed as dist
from lightning_dp.comm.cluster import rendezvous
rendezvous.init_bound_process_group("gloo", "127.0.0.1", {free_port()}, 0, 1, timedelta(seconds=20), single_host=True)
dist.all_gather([torch.empty(4)], torch.ones(4))
atexit._run_exitfuncs()  # what the interpreter runs before it finalizes
print("closed", dist.is_initialized())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "closed False" in out.stdout, out.stderr[-3000:]


@pytest.mark.unit
def test_a_launch_is_handed_only_to_the_ranks_it_starts(monkeypatch):
    """Lightning's launchers put the launch into the environment of the ranks they start, and nowhere else: a
    torchrun, srun or Ray run this process starts later must not take it for its own (it names a launcher pid)."""
    import lightning as L

    from lightning_dp.comm.cluster import rendezvous
    from lightning_dp.strategies.launchers import launch_variable_for_children

    monkeypatch.delenv(rendezvous.LAUNCH_VARIABLE, raising=False)
    monkeypatch.setattr(rendezvous, "_launch", None)
    L.Trainer(strategy="ring_allreduce", accelerator="cpu", devices=2, logger=False)  # configures the launcher
    assert rendezvous.LAUNCH_VARIABLE not in os.environ
    with launch_variable_for_children():
        handed = os.environ[rendezvous.LAUNCH_VARIABLE]
        assert rendezvous.this_launch() == handed and rendezvous.launcher_pid() == os.getpid()
    assert rendezvous.LAUNCH_VARIABLE not in os.environ
    # a rank takes its launch out of the environment at once, so its own children do not inherit it
    monkeypatch.setattr(rendezvous, "_launch", None)
    monkeypatch.setenv(rendezvous.LAUNCH_VARIABLE, "12345:abc")
    assert rendezvous.this_launch() == "12345:abc" and rendezvous.launcher_pid() == 12345
    assert rendezvous.LAUNCH_VARIABLE not in os.environ
    monkeypatch.setattr(rendezvous, "_launch", None)


@pytest.mark.unit
def test_a_record_published_for_a_group_ray_created_lets_hand_started_servers_join(monkeypatch):
    """Where Ray created the default group no rendezvous of ours wrote a record: trainer 0 publishes one for the
    servers' scope, and a server pointed at the port finds it (and its secret check) as under any launcher."""
    from datetime import timedelta

    from lightning_dp.comm.errors import ForeignJobError
    from lightning_dp.comm.servers import run_store
    from tests.helpers.distributed import free_port

    monkeypatch.setenv("LIGHTNING_DP_JOB_SECRET", "s3")
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    trainer = run_store("127.0.0.1", port, "0", timedelta(seconds=5), scope="lightning_dp/external", publish=True)
    trainer.set("plan", "p")
    joined = run_store("127.0.0.1", port, "0", timedelta(seconds=5))
    assert joined.get("plan") == b"p"
    monkeypatch.setenv("LIGHTNING_DP_JOB_SECRET", "other")
    with pytest.raises(ForeignJobError, match="shared secret"):
        run_store("127.0.0.1", port, "0", timedelta(seconds=5))
    del server


@pytest.mark.unit
def test_the_members_reach_the_job_s_store_again_only_where_it_serves_the_same_job(monkeypatch):
    """A job that lost its rank 0 looks for its store where rank 0 served it: nothing there, another job's record, or
    the record of the same job without its secret or of another restart attempt is no store; the same attempt's,
    served again, is (under the new process's scope)."""
    from datetime import timedelta

    from lightning_dp.comm.cluster.rendezvous import JOB_RECORD_KEY, JobRecord, _proof, reach_job_store
    from tests.helpers.distributed import free_port

    monkeypatch.setenv("LIGHTNING_DP_JOB_SECRET", "s3")
    port, scope = free_port(), "lightning_dp/job-a/0/0"
    started = time.monotonic()
    assert reach_job_store(scope, "127.0.0.1", port, timeout=1.0) is None  # nothing listens
    assert time.monotonic() - started < 2.0
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    assert reach_job_store(scope, "127.0.0.1", port) is None  # served, no record yet
    server.set(JOB_RECORD_KEY, JobRecord("job-b", "lightning_dp/job-b/0/0", _proof("job-b")).dumps())
    assert reach_job_store(scope, "127.0.0.1", port) is None  # another job's
    server.set(JOB_RECORD_KEY, JobRecord("job-a", scope, "a proof without the secret").dumps())
    assert reach_job_store(scope, "127.0.0.1", port) is None
    server.set(JOB_RECORD_KEY, JobRecord("job-a", "lightning_dp/job-a/1/0", _proof("job-a")).dumps())
    assert reach_job_store(scope, "127.0.0.1", port) is None  # another restart attempt of the job
    # the same attempt, from another launch (a launcher's nonce, a rendezvous count): under the new process's scope
    server.set(JOB_RECORD_KEY, JobRecord("job-a", "lightning_dp/job-a/0/f00d", _proof("job-a")).dumps())
    reached = reach_job_store(scope, "127.0.0.1", port)
    assert reached is not None
    reached.set("membership/directory", "kept")
    assert server.get("lightning_dp/job-a/0/f00d/job/membership/directory") == b"kept"
    del server


@pytest.mark.unit
def test_rank_0_waits_for_the_other_ranks_or_a_running_job_and_says_why_when_neither_comes():
    """Rank 0 of a fresh store goes on once every other rank of its job is present, or once the members of a running
    job kept their directory there (then it joins them; a new process in another lost rank's place present before
    them does not make it start a job of its own); with neither, it stops at its timeout naming the job id and
    secret (planted: going on with one rank present of three fails the second case)."""
    from datetime import timedelta

    from lightning_dp.comm.cluster.rendezvous import DIRECTORY_KEY, PRESENT_KEY, _await_the_job

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    scope = "lightning_dp/job-a/0/0"
    starting = dist.PrefixStore(f"{scope}/starting", master)
    for delay in (0.2, 0.4):  # two other ranks, the second later
        threading.Timer(delay, lambda: starting.add(PRESENT_KEY, 1)).start()
    started = time.monotonic()
    _await_the_job(starting, scope, "127.0.0.1:1", 3, timedelta(seconds=10))
    assert 0.35 < time.monotonic() - started < 5.0
    running = dist.PrefixStore(f"{scope}/running", master)
    running.add(PRESENT_KEY, 1)  # a new process in rank 2's place, before the members kept their directory there
    threading.Timer(0.3, lambda: running.set(DIRECTORY_KEY, "{}")).start()
    started = time.monotonic()
    _await_the_job(running, scope, "127.0.0.1:1", 3, timedelta(seconds=10))
    assert 0.25 < time.monotonic() - started < 5.0 and running.check([DIRECTORY_KEY])
    alone = dist.PrefixStore(f"{scope}/alone", master)
    with pytest.raises(TimeoutError, match=r"job 'job-a'.*LIGHTNING_DP_JOB_ID.*LIGHTNING_DP_JOB_SECRET"):
        _await_the_job(alone, scope, "127.0.0.1:1", 2, timedelta(seconds=0.5))
