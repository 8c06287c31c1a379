"""Codecs over every socket transport: bounded error, error feedback that tracks the exact sum, identical replicas."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_dp.comm.buckets import BucketReducer
from lightning_dp.comm.codecs import Codec, HalfPrecisionCodec, PowerSGDCodec, compression_ratio, make_codec
from lightning_dp.comm.codecs.powersgd import _orthogonalize
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.stats import CommStats
from lightning_dp.comm.transports import (
    CentralServerTransport,
    RingTransport,
    ShardedServerTransport,
    SharedMemoryTransport,
)

WORLD = 3
TRANSPORTS = {
    "ring": lambda stats: RingTransport(stats=stats),
    "central": lambda stats: CentralServerTransport(1, stats=stats),
    "sharded": lambda stats: ShardedServerTransport(stats=stats),
    # three nodes of one rank: the 16-bit wire is the ring across nodes
    "hierarchical": lambda stats: SharedMemoryTransport(stats=stats, node_key=dist.get_rank()),
}
CODECS = {
    "none": lambda ef: Codec(),
    "bf16": lambda ef: HalfPrecisionCodec(torch.bfloat16, ef),
    "fp16": lambda ef: HalfPrecisionCodec(torch.float16, ef),
    "powersgd": lambda ef: PowerSGDCodec(rank=4, warmup_steps=1, error_feedback=ef),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 24), nn.Linear(24, 3))


def _gradients(model: nn.Module, rank: int, step: int, low_rank: bool) -> dict[int, torch.Tensor]:
    """Rank ``rank``'s gradients at ``step`` (every rank can compute every rank's); rank-1 matrices if ``low_rank``."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    grads = {}
    for p in model.parameters():
        if low_rank and p.dim() == 2:
            u = torch.randn(p.shape[0], 1, generator=generator)
            v = torch.randn(1, p.shape[1], generator=generator)
            grads[id(p)] = u @ v
        else:
            grads[id(p)] = torch.randn(p.shape, generator=generator)
    return grads


#: what each transport runs, in one launch: (codec, steps, low-rank gradients, error feedback, same gradients each step)
CASES = {
    "none": ("none", 1, False, True, False),
    "bf16": ("bf16", 3, False, True, False),
    "fp16": ("fp16", 3, False, True, False),
    "powersgd-low-rank": ("powersgd", 3, True, True, False),
    "powersgd-ef": ("powersgd", 24, False, True, True),
    "powersgd-no-ef": ("powersgd", 24, False, False, True),
}
RUNS = {
    "ring": list(CASES),
    "central": ["none", "bf16", "fp16"],
    "sharded": ["none", "bf16", "fp16", "powersgd-low-rank"],
    "hierarchical": ["none", "bf16", "fp16"],
}


def _synchronize(rank: int, world_size: int, kind: str, codec_name: str, steps: int, low_rank: bool, ef: bool,
                 constant: bool) -> list:  # fmt: skip
    model = _model()
    reducer = BucketReducer(model.parameters(), lambda b: None, bucket_cap_mb=2000 * 4 / 2**20)
    stats = CommStats()
    transport = TRANSPORTS[kind](stats)
    transport.bind(reducer.buckets)
    codec = CODECS[codec_name](ef)
    codec.bind(reducer.buckets, transport)
    results, exact = [], []
    for step in range(steps):
        seed = 0 if constant else step
        mine = _gradients(model, rank, seed, low_rank)
        every = [_gradients(model, r, seed, low_rank) for r in range(world_size)]
        for bucket in reducer.buckets:
            for i, p in enumerate(bucket.params):
                bucket.fill(i, mine[id(p)])
        for bucket in reducer.buckets:
            codec.reduce(bucket, transport)
            codec.share(bucket, transport)
        results.append(torch.cat([b.buffer[: b.grad_numel].clone() for b in reducer.buckets]))
        exact.append(
            torch.cat(
                [
                    torch.cat([sum(g[id(p)] for g in every).reshape(-1) / world_size for p in b.params])
                    for b in reducer.buckets
                ]
            )
        )
        assert all((b.flags != 0).all() for b in reducer.buckets)
    sent = stats.reset()[0]
    ratio = compression_ratio(codec, reducer.buckets)
    reducer.close()
    transport.close()
    return [torch.stack(results).tolist(), torch.stack(exact).tolist(), sent, ratio]


def _every_case(rank: int, world_size: int, kind: str) -> dict:
    return {case: _synchronize(rank, world_size, kind, *CASES[case]) for case in RUNS[kind]}


@functools.cache
def _launch(kind: str) -> dict:
    """Every case of ``kind`` in one launch (shared by the tests below)."""
    from tests.helpers.distributed import run_distributed

    return {"ranks": run_distributed(_every_case, WORLD, kind, timeout=240)}


def _check(kind: str, case: str):
    """``(results, exact averages, bytes sent by each rank, compression ratio)`` of one case; replicas identical."""
    ranks = [r[case] for r in _launch(kind)["ranks"]]
    for other in ranks[1:]:
        assert other[0] == ranks[0][0], "replicas differ"
    return torch.tensor(ranks[0][0]), torch.tensor(ranks[0][1]), [r[2] for r in ranks], ranks[0][3]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", sorted(TRANSPORTS))
def test_16_bit_codecs_halve_the_bytes_and_stay_within_their_rounding(kind):
    _, _, plain_bytes, _ = _check(kind, "none")
    for name, eps in (("bf16", 2.0**-8), ("fp16", 2.0**-11)):
        results, exact, sent, ratio = _check(kind, name)
        # one rounding of each contribution, the ring's rounded partial sums, and the last step's residual
        bound = 2 * (WORLD + 1) * eps * exact.abs().max().item()
        assert (results - exact).abs().max().item() <= bound, (name, kind)
        assert ratio == 0.5
        if kind in ("ring", "central", "hierarchical"):
            assert sum(sent) * 2 == sum(plain_bytes) * 3  # 3 steps at half the bytes of 1
        else:  # the sharded servers' flags travel as float32
            assert sum(sent) < sum(plain_bytes) * 3 / 2 * 1.05


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ring", "sharded"])
def test_powersgd_is_exact_on_low_rank_gradients_and_sends_its_factors(kind):
    results, exact, sent, ratio = _check(kind, "powersgd-low-rank")
    # the average of 3 rank-1 matrices has rank 3 < 4: P spans it (its 4th column orthogonal to it), P P^T M
    # recovers it
    assert torch.allclose(results, exact, atol=1e-4, rtol=1e-4)
    _, _, plain, _ = _check(kind, "none")
    if kind == "ring":  # warm-up step uncompressed, then two steps of factors: each all-reduce moves 2 (N-1) L
        assert sum(sent) == pytest.approx(sum(plain) * (1 + 2 * ratio), rel=0.01)
    assert ratio < 0.5


@pytest.mark.multiprocess
def test_powersgd_error_feedback_tracks_the_sum_of_full_rank_gradients():
    # the same gradients every step: without feedback the same part is missing every time
    results, exact, _, _ = _check("ring", "powersgd-ef")
    results_no_ef, _, _, _ = _check("ring", "powersgd-no-ef")
    drift = (results.sum(0) - exact.sum(0)).norm().item()
    drift_no_ef = (results_no_ef.sum(0) - exact.sum(0)).norm().item()
    one_step = exact[0].norm().item()
    # bounded by what the residuals hold (measured: 63 after 12 steps, 66 after 30); without feedback the same
    # missing part adds up every step (165 after 12, 435 after 30)
    assert drift <= 4 * one_step
    assert drift < 0.25 * drift_no_ef


def _constant_buckets(rank: int, world_size: int, steps: int) -> list:
    sums = [_constant_bucket(ef, steps, skip) for ef, skip in ((True, False), (False, False), (True, True))]
    return [*sums, _server_never_uses(rank, steps)]


def _server_never_uses(rank: int, steps: int) -> list:
    """Central server (rank 0) in full-gradient mode that never uses the layer the others use: the server's
    roundings of the averages it sends must still leave with its next contributions."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8, bias=False)
    reducer = BucketReducer(layer.parameters(), lambda b: None)
    transport = CentralServerTransport(0)
    codec = make_codec("bf16")
    codec.bind(reducer.buckets, transport)
    total = torch.zeros(64)
    for _ in range(steps):
        bucket = reducer.buckets[0]
        bucket.fill(0, None if rank == 0 else torch.full((8, 8), 1 + 2.0**-10))
        codec.reduce(bucket, transport)
        codec.share(bucket, transport)
        total += bucket.buffer[:64]
    reducer.close()
    return total.tolist()


def _constant_bucket(ef: bool, steps: int, skip_odd_steps: bool) -> list:
    """Every rank sends 1 + 2^-10 (which bfloat16 rounds to 1) for ``steps`` steps, or on odd steps no gradient at
    all (no rank uses the parameter); returns the sum of the averages of the steps that used it."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8, bias=False)
    reducer = BucketReducer(layer.parameters(), lambda b: None)
    transport = RingTransport()
    codec = make_codec("bf16", error_feedback=ef)
    codec.bind(reducer.buckets, transport)
    total = torch.zeros(64)
    for step in range(steps):
        bucket = reducer.buckets[0]
        unused = skip_odd_steps and step % 2 == 1
        bucket.fill(0, None if unused else torch.full((8, 8), 1 + 2.0**-10))
        codec.reduce(bucket, transport)
        if not unused:
            total += bucket.buffer[:64]
    reducer.close()
    return total.tolist()


@pytest.mark.multiprocess
def test_error_feedback_keeps_the_sum_of_updates_on_the_exact_sum():
    from tests.helpers.distributed import run_distributed

    steps = 64
    exact = steps * (1 + 2.0**-10)
    sums = run_distributed(_constant_buckets, WORLD, steps)[0]
    with_feedback, without, used_every_other_step, server_never_uses = map(torch.tensor, sums)
    # with feedback the sum is off by at most what one step's rounding holds back; without, every step loses 2^-10
    assert (with_feedback - exact).abs().max().item() <= 2 * 2.0**-8
    assert (without - exact).abs().min().item() >= steps * 2.0**-10 * 0.9
    # steps where no rank uses the parameter keep its residual for the next step that does
    assert (used_every_other_step - exact / 2).abs().max().item() <= 2 * 2.0**-8
    # a server that never uses the parameter still passes on what rounding its averages lost
    assert (server_never_uses - exact * (WORLD - 1) / WORLD).abs().max().item() <= 2 * 2.0**-8


def _powersgd_after_a_zero_gradient(rank: int, world_size: int) -> list:
    """The first compressed step sees an all-zero gradient (Q would become 0); later gradients must still arrive."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 16, bias=False)
    reducer = BucketReducer(layer.parameters(), lambda b: None)
    transport = RingTransport()
    codec = PowerSGDCodec(rank=2, warmup_steps=0)
    codec.bind(reducer.buckets, transport)
    norms = []
    for step in range(3):
        bucket = reducer.buckets[0]
        bucket.fill(0, torch.zeros(16, 16) if step == 0 else torch.ones(16, 16))
        codec.reduce(bucket, transport)
        norms.append(bucket.buffer[:256].norm().item())
    reducer.close()
    return norms


@pytest.mark.multiprocess
def test_powersgd_recovers_from_an_all_zero_gradient():
    from tests.helpers.distributed import run_distributed

    norms = run_distributed(_powersgd_after_a_zero_gradient, WORLD)[0]
    assert norms[0] == 0.0
    assert norms[2] == pytest.approx(16.0, rel=1e-4)  # rank-1 gradient of ones: recovered exactly again


def _weights_in_16_bits(rank: int, world_size: int, steps: int, delta: float) -> dict:
    return {kind: _weights_over(kind, steps, delta) for kind in ("central", "sharded")}


def _weights_over(kind: str, steps: int, delta: float) -> list:
    """The owners add ``delta`` (far below bfloat16's resolution at 1.0) to their weights every step."""
    layer = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    reducer = BucketReducer(layer.parameters(), lambda b: None)
    transport = TRANSPORTS[kind](None)
    transport.bind(reducer.buckets)
    codec = HalfPrecisionCodec(torch.bfloat16)
    codec.bind(reducer.buckets, transport)
    bucket = reducer.buckets[0]
    for step in range(steps):
        if step == steps // 2:  # every rank edits its weights between steps (a clamp, a projection)
            with torch.no_grad():
                layer.weight.mul_(0.5)
        codec.before_update(bucket, transport)
        start, end = transport.owned(bucket)
        with torch.no_grad():
            layer.weight.view(-1)[start:end] += delta  # the optimizer's step on the full-precision weights
        bucket.pack_params(start, end)
        codec.share_weights(bucket, transport)
        bucket.unpack_params()
    reducer.close()
    return layer.weight.detach().reshape(-1).tolist()


@pytest.mark.multiprocess
def test_weights_in_16_bits_lose_no_update_and_replicas_stay_identical():
    from tests.helpers.distributed import run_distributed

    steps, delta = 100, 1e-4
    ranks = run_distributed(_weights_in_16_bits, WORLD, steps, delta)
    for kind in ("central", "sharded"):
        assert ranks[0][kind] == ranks[1][kind] == ranks[2][kind], kind
        weights = torch.tensor(ranks[0][kind])
        # plain bfloat16 weights would stay at 1.0 (1e-4 is below half a bfloat16 step at 1.0); the edit halfway
        # holds, as it would under ddp
        expected = (1 + steps // 2 * delta) * 0.5 + (steps - steps // 2) * delta
        assert (weights - expected).abs().max().item() < 1e-5, kind


@pytest.mark.unit
def test_codec_options_are_checked():
    with pytest.raises(ConfigurationError, match="compression='zip'.*'none', 'fp16', 'bf16', 'powersgd'"):
        make_codec("zip")
    with pytest.raises(ConfigurationError, match="float16 or torch.bfloat16"):
        HalfPrecisionCodec(torch.float32)


@pytest.mark.unit
def test_compression_refuses_16_bit_gradients():
    layer = nn.Linear(4, 4).to(torch.bfloat16)
    reducer = BucketReducer(layer.parameters(), lambda b: None)
    reducer.close()
    for codec in (HalfPrecisionCodec(), PowerSGDCodec()):
        with pytest.raises(ConfigurationError, match="torch.bfloat16 .* already travel in 16 bits"):
            codec.bind(reducer.buckets, None)  # type: ignore[arg-type]  # refused before the transport is used


@pytest.mark.unit
def test_a_compressing_codec_refuses_a_transport_of_full_precision_buckets_when_bound():
    from lightning_dp.comm.servers import DedicatedServerTransport
    from lightning_dp.comm.transports import SharedMemoryServerTransport, SharedMemoryShardedTransport

    reducer = BucketReducer(nn.Linear(4, 4).parameters(), lambda b: None)
    reducer.close()
    for kind in (SharedMemoryServerTransport, SharedMemoryShardedTransport, DedicatedServerTransport):
        plain = object.__new__(kind)  # never used: the refusal comes first
        for codec in (HalfPrecisionCodec(), PowerSGDCodec()):
            with pytest.raises(ConfigurationError, match=f"cannot run over {kind.__name__}.*compression='none'"):
                codec.bind(reducer.buckets, plain)


class ReducedPrecisionMatmuls(TorchFunctionMode):
    """float32 matrix products as tensor cores run them under ``torch.set_float32_matmul_precision("high")``: each
    operand cut to TF32 (the hardware keeps 10 of the 23 bits of mantissa, dropping the rest), the products summed in
    float32."""

    PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "mv", "einsum", "tensordot", "linear"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.PRODUCTS:
            args = tuple(_tf32(a) for a in args)
        return func(*args, **(kwargs or {}))


def _tf32(value):
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return value
    return (value.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32).view(value.shape)


@pytest.mark.unit
@pytest.mark.parametrize("spread", [1e-3, 1e-2, 1.0])
def test_powersgd_factors_stay_orthonormal_under_reduced_precision_matmuls(spread):
    """Lightning recommends ``set_float32_matmul_precision("high")`` on recent GPUs, which runs float32 products in
    TF32: the Gram-Schmidt of the P factors must not lose orthogonality to it. ``spread``: how far the columns are
    from parallel (P = M Q of a gradient dominated by one direction has nearly parallel columns)."""
    with ReducedPrecisionMatmuls():
        assert (torch.tensor([[1.0 + 2**-12]]) @ torch.tensor([[1.0]])).item() == 1.0  # the emulation cuts
    worst = 0.0
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        p = torch.randn(64, 1, generator=generator) + spread * torch.randn(64, 4, generator=generator)
        with ReducedPrecisionMatmuls():
            _orthogonalize(p)
        gram = p.double().t() @ p.double()
        worst = max(worst, (gram - torch.eye(4, dtype=torch.float64)).abs().max().item())
    # float32 Gram-Schmidt: a few units of float32's 2^-24 times the columns' condition, far below TF32's 2^-11
    assert worst < 1e-5, worst
