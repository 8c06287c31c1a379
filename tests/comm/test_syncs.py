"""The exchange path waits for the device only where it says why (``# sync:``, listed in ``docs/gpus.md``).

On CPUs every host read of a tensor's values stands in for a synchronization (on a GPU each one waits for the
device): the reducer, every socket transport, the codecs, the sharded servers' gradients and the step's checks run
for a few steps on two ranks, and every read they make must be on a marked line, as many per step as the guide
says. ``tests/test_gpu.py`` runs the same path on a GPU under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import re
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dp.comm.buckets import BucketReducer
from lightning_dp.comm.codecs import Codec, make_codec
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.servers.sharded_optimizer import ShardLayout
from lightning_dp.comm.transports import CentralServerTransport, RingTransport, ShardedServerTransport
from lightning_dp.comm.transports.shards import any_rank
from tests.helpers.distributed import run_distributed
from tests.helpers.syncs import PACKAGE, HostReads, describe, marked

KINDS = {"ring": RingTransport, "central": lambda: CentralServerTransport(0), "sharded": ShardedServerTransport}
CODECS = ("none", "bf16", "powersgd")
WARMUP, STEPS = 2, 3


def exchange_path_sites(device: torch.device, recorder, exchange_recorder=None) -> dict[str, list]:
    """For every transport kind and codec: a few steps of the exchange path on ``device`` (backward with a parameter
    no rank uses, the buckets reduced on the communication thread, ``param.grad`` written back, the sharded servers'
    gradients, the NaN/inf check and the servers' vote); after the warm-up ``recorder(sites)`` is entered around each
    step on the main thread and ``exchange_recorder(sites)`` (default: ``recorder``) around each exchange on the
    communication thread. Returns the recorded sites per ``"kind/codec"``."""
    exchange_recorder = exchange_recorder or recorder
    found = {}
    for kind_name, kind in KINDS.items():
        for codec_name in CODECS:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 8)).to(device)
            unused = nn.Linear(8, 8).to(device)  # never produces a gradient: its flags stay 0
            params = [*model.parameters(), *unused.parameters()]
            sites: list = []
            recording = [False]
            transport = kind()
            codec = (
                Codec() if codec_name == "none" else make_codec(codec_name, powersgd_rank=2, powersgd_warmup_steps=1)
            )

            def exchange(bucket, transport=transport, codec=codec, sites=sites, recording=recording):
                with exchange_recorder(sites) if recording[0] else nullcontext():
                    codec.reduce(bucket, transport)
                    codec.share(bucket, transport)

            reducer = BucketReducer(params, exchange, bucket_cap_mb=32 * 32 * 4 / 2**20, device=device)
            assert len(reducer.buckets) >= 3
            transport.bind(reducer.buckets)
            codec.bind(reducer.buckets, transport)
            sharded = kind_name == "sharded"
            layout = ShardLayout(reducer.buckets, transport.segments, transport.rank) if sharded else None
            for step in range(WARMUP + STEPS):
                recording[0] = step >= WARMUP
                for p in params:
                    p.grad = None
                with recorder(sites) if recording[0] else nullcontext():
                    model(torch.randn(4, 16, device=device)).square().mean().backward()
                    reducer.finish(copy_back=True)
                    if layout is not None:
                        layout.take_bucket_gradients()
                    first_nonfinite([(p, p.grad) for p in params if p.grad is not None])
                    any_rank(False, transport.ring, device)
            reducer.close()
            assert unused.weight.grad is None and model[0].weight.grad is not None
            found[f"{kind_name}/{codec_name}"] = sites
    return found


def named_in_guide() -> set[str]:
    """The ``file:function`` of every synchronization ``docs/gpus.md`` names."""
    guide = (PACKAGE.parent / "docs" / "gpus.md").read_text()
    return set(re.findall(r"`(lightning_dp/[\w/]+\.py):(\w+)`", guide))


def _host_reads(rank, world_size):
    found = exchange_path_sites(torch.device("cpu"), HostReads)
    return {key: [(file, line) for file, line in sites] for key, sites in found.items()}


@pytest.mark.multiprocess
def test_host_reads_of_the_exchange_path_are_the_named_ones_once_per_step():
    per_rank = run_distributed(_host_reads, 2, timeout=120)
    for rank, found in enumerate(per_rank):
        assert sorted(found) == sorted(f"{k}/{c}" for k in KINDS for c in CODECS)
        for key, sites in found.items():
            unmarked = [describe(site) for site in sites if not marked(site)]
            assert not unmarked, f"rank {rank}, {key}: host reads without a '# sync:' reason:\n" + "\n".join(unmarked)
            counts = Counter(_function_of(site) for site in sites)
            expected = {"read_used": 2 if key.startswith("sharded") else 1, "first_nonfinite": 1, "any_rank": 1}
            assert counts == Counter({f: n * STEPS for f, n in expected.items()}), (rank, key, counts)


@pytest.mark.unit
def test_the_guide_names_every_marked_synchronization():
    marked_functions = set()
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if "# sync:" in line:
                marked_functions.add((str(path.relative_to(PACKAGE.parent)), _enclosing_function(lines, number)))
    assert marked_functions and marked_functions == named_in_guide()


def _function_of(site) -> str:
    return _enclosing_function(Path(site[0]).read_text().splitlines(), site[1])


def _enclosing_function(lines: list[str], number: int) -> str:
    for line in reversed(lines[:number]):
        match = re.match(r"\s*def (\w+)", line)
        if match:
            return match.group(1)
    raise AssertionError(f"line {number} is outside any function")
