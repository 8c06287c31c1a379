"""Staging through host memory (device buckets over gloo), with CPU tensors standing in for the device: the choice
of mode, every socket transport and codec giving the same bits staged as in place while no message touches a
bucket's own memory, and failures inside a wait reported as what they are."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dp.comm.buckets import BucketReducer, GradientBucket
from lightning_dp.comm.codecs import Codec, HalfPrecisionCodec, PowerSGDCodec
from lightning_dp.comm.errors import PeerUnreachableError
from lightning_dp.comm.transports import CentralServerTransport, RingTransport, ShardedServerTransport
from lightning_dp.comm.transports.p2p import _ThroughHost, wait_for
from lightning_dp.comm.transports.staging import HostStaging, Staging, staging_for
from tests.helpers.distributed import run_distributed

WORLD = 3
TRANSPORTS = {
    "ring": lambda: RingTransport(),
    "central": lambda: CentralServerTransport(1),
    "sharded": lambda: ShardedServerTransport(),
}
CODECS = {
    "none": lambda: Codec(),
    "bf16": lambda: HalfPrecisionCodec(torch.bfloat16),
    "powersgd": lambda: PowerSGDCodec(rank=2, warmup_steps=1),
}
#: the servers' weight exchange runs for the parameter-server transports with these codecs
WEIGHT_CODECS = ("none", "bf16")
STEPS = 3


def _bucket_on(device: str) -> GradientBucket:
    return GradientBucket(
        0, [nn.Parameter(torch.zeros(5, device=device)), nn.Parameter(torch.zeros(2, 3, device=device))]
    )


@pytest.mark.unit
def test_host_staging_is_chosen_for_device_buckets_over_gloo_only():
    on_host, on_device = [_bucket_on("cpu")], [_bucket_on("meta")]  # "meta" stands in for a CUDA device
    assert type(staging_for("gloo", on_host)) is Staging
    assert type(staging_for("nccl", on_host)) is Staging
    assert type(staging_for("gloo", on_device)) is HostStaging
    assert type(staging_for("nccl", on_device)) is Staging


@pytest.mark.unit
def test_host_staging_refuses_a_tensor_larger_than_its_bucket():
    bucket = _bucket_on("cpu")
    staging = HostStaging()
    staging.bind([bucket])
    with pytest.raises(ValueError, match="at most 13 elements"), staging.tensor(torch.zeros(14), bucket):
        pass
    with staging.tensor(torch.ones(13), bucket) as (staged, staged_bucket):
        assert staged.data_ptr() != bucket.buffer.data_ptr() and staged_bucket.buffer is not bucket.buffer


@pytest.mark.unit
def test_a_staged_bucket_mirrors_the_layout_in_other_memory():
    bucket = _bucket_on("cpu")
    bucket.fill(1, torch.full((2, 3), 2.0))
    staging = HostStaging()
    staging.bind([bucket])
    with staging.bucket(bucket) as (staged, residual):
        assert residual is None and staged.index == bucket.index and staged.slices == bucket.slices
        assert staged.buffer.data_ptr() != bucket.buffer.data_ptr()
        assert torch.equal(staged.buffer, bucket.buffer) and torch.equal(staged.flags, torch.tensor([0.0, 1.0]))
        staged.buffer.add_(1.0)
    assert torch.equal(bucket.buffer[:5], torch.ones(5)) and torch.equal(bucket.flags, torch.tensor([1.0, 2.0]))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Linear(16, 6))


class _MessageLog:
    """Every point-to-point message's memory, as ``(first byte, end)`` (``dist.batch_isend_irecv`` carries them all)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._batch = dist.batch_isend_irecv

    def __enter__(self) -> _MessageLog:
        def logged(ops):
            for op in ops:
                t = op.tensor
                self.ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
            return self._batch(ops)

        dist.batch_isend_irecv = logged
        return self

    def __exit__(self, *exc) -> None:
        dist.batch_isend_irecv = self._batch

    def touches(self, tensors: list[torch.Tensor]) -> bool:
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()]
        return any(a < d and c < b for a, b in self.ranges for c, d in spans)


def _codec_state(codec: Codec) -> list[torch.Tensor]:
    """The codec's own tensors that a transport reads or writes (residuals, low-rank factors)."""
    return [*getattr(codec, "residuals", {}).values(), *getattr(codec, "factors", {}).values()]


def _run(rank: int, kind: str, codec_name: str, staging: Staging | None) -> dict:
    """``STEPS`` synchronizations (and, for the servers, weight exchanges) of ``kind`` with ``codec_name``."""
    model = _model()
    reducer = BucketReducer(model.parameters(), lambda b: None, bucket_cap_mb=300 * 4 / 2**20)
    transport = TRANSPORTS[kind]()
    transport.bind(reducer.buckets, staging)
    codec = CODECS[codec_name]()
    codec.bind(reducer.buckets, transport)
    servers = kind != "ring" and codec_name in WEIGHT_CODECS
    with _MessageLog() as log:
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 * step + rank)
            for bucket in reducer.buckets:
                for i, p in enumerate(bucket.params):
                    bucket.fill(i, torch.randn(p.shape, generator=generator) if (i + step) % 4 else None)
                codec.reduce(bucket, transport)
                codec.share(bucket, transport)
            grads = [b.buffer.clone() for b in reducer.buckets]
            if servers:  # the owners move their weights against the averaged gradients, then everyone pulls them
                for bucket, grad in zip(reducer.buckets, grads, strict=True):
                    codec.before_update(bucket, transport)
                    start, end = transport.owned(bucket)
                    values = bucket.read_params(start, end, torch.empty(end - start))
                    bucket.write_params(start, end, values - 0.1 * grad[start:end])
                    bucket.pack_params(start, end)
                    codec.share_weights(bucket, transport)
                    bucket.unpack_params()
    protected = [b.buffer for b in reducer.buckets] + _codec_state(codec)
    result = {  # numpy arrays: tensors would reach the test through shared memory the worker frees as it exits
        "grads": [g.numpy() for g in grads],
        "weights": [p.detach().numpy().copy() for p in model.parameters()],
        "state": [t.numpy().copy() for t in _codec_state(codec)],
        "touches_buckets": log.touches(protected),
        "messages": len(log.ranges),
    }
    reducer.close()
    return result


def _staged_and_in_place(rank: int, world_size: int, kind: str) -> dict:
    return {
        (codec, mode): _run(rank, kind, codec, HostStaging() if mode == "staged" else None)
        for codec in CODECS
        for mode in ("in place", "staged")
    }


@functools.cache
def _launch(kind: str) -> list[dict]:
    return run_distributed(_staged_and_in_place, WORLD, kind, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(TRANSPORTS))
def test_staged_exchanges_give_the_same_bits_through_other_memory(kind):
    ranks = _launch(kind)
    for rank, runs in enumerate(ranks):
        for codec in CODECS:
            direct, staged = runs[(codec, "in place")], runs[(codec, "staged")]
            what = f"{kind} + {codec}, rank {rank}"
            assert direct["messages"] > 0 and direct["messages"] == staged["messages"], what
            # the log sees the buckets' own memory when nothing stages them (16-bit codecs send rounded copies,
            # except the sharded servers' used-flags), and never when they are staged
            assert direct["touches_buckets"] or codec == "bf16" and kind != "sharded", what
            assert not staged["touches_buckets"], what
            for key in ("grads", "weights", "state"):
                assert len(direct[key]) == len(staged[key]) > 0 or key == "state" and codec == "none", (what, key)
                for a, b in zip(direct[key], staged[key], strict=True):
                    assert np.array_equal(a, b), f"{what}: {key} differ staged"
            if kind == "ring" or codec in WEIGHT_CODECS:  # every rank holds the same weights
                for a, b in zip(staged["weights"], ranks[0][(codec, "staged")]["weights"], strict=True):
                    assert np.array_equal(a, b), f"{what}: weights differ from rank 0's"


class _FailingWork:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self, timeout=None) -> bool:
        raise self.error


def _wait_errors(rank: int, world_size: int) -> list[str]:
    seen = []
    for error in (RuntimeError("CUDA error: an illegal memory access was encountered"),
                  RuntimeError("[pair.cc:545] Read error [127.0.0.1]:2465: Connection reset by peer")):  # fmt: skip
        try:
            wait_for(_FailingWork(error), None, 1 - rank, "receive from")
        except Exception as raised:  # noqa: BLE001 - what is raised is the result
            seen.append(f"{type(raised).__name__}: {raised}")
    return seen


@pytest.mark.multiprocess
def test_a_failure_that_is_not_a_lost_peer_is_reported_as_itself():
    local, lost = run_distributed(_wait_errors, 2, timeout=60)[0]
    assert local == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert lost.startswith(f"{PeerUnreachableError.__name__}: rank 0 could not receive from rank 1"), lost


@pytest.mark.unit
def test_a_message_through_host_lands_in_its_tensor_when_waited_for():
    class Done:
        def wait(self, timeout=None) -> bool:
            return True

    target, host = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    work = _ThroughHost(Done(), host, target)
    assert torch.equal(target, torch.zeros(3))  # nothing lands before the wait
    work.wait()
    assert torch.equal(target, host)
    sent = _ThroughHost(Done(), host, None)
    assert sent.wait() and torch.equal(host, torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.unit
def test_a_coalesced_batch_gives_every_operation_its_work(monkeypatch):
    """NCCL returns one work for a whole batch: every operation gets it, so a caller waiting for any operation
    (the third receive of a server's fan-in, say) waits for the batch, never for nothing."""
    from lightning_dp.comm.transports import p2p

    class Work:
        waited = 0

        def wait(self, timeout=None) -> bool:
            Work.waited += 1
            return True

    batch_work = Work()
    posted = []
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(p2p.dist, "P2POp", lambda op, tensor, group=None, tag=0, group_peer=None: (op, group_peer))
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", lambda batch: posted.append(batch) or [batch_work])
    ops = [("recv", torch.zeros(2), 1, 0), ("send", torch.zeros(0), 2, 0), ("recv", torch.zeros(2), 3, 0)]
    works = p2p.post(ops, group=None)
    assert len(posted[0]) == 2  # the empty tensor is skipped
    assert works == [batch_work, None, batch_work]
    monkeypatch.setattr(p2p.dist, "get_rank", lambda group=None: 0)
    wait_for(works[2], None, 3, "receive from")
    assert Work.waited == 1
    # gloo's one work per operation is kept as it is; any other count is an error, not a silent miss
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", lambda batch: [Work(), Work()])
    first, _, last = p2p.post(ops, group=None)
    assert first is not last
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", lambda batch: [Work(), Work(), Work()])
    with pytest.raises(RuntimeError, match="a batch of 2 point-to-point operations returned 3 works"):
        p2p.post(ops, group=None)
