"""The GPU tiers (skipped without CUDA; ``python -m benchmarks.gpu_check`` runs them in stages and reports).

One GPU (``shared_gpu``): two ranks share it over gloo, started as two single-device nodes (Lightning's
general-purpose cluster recipe: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE=2``, ``NODE_RANK``,
``LOCAL_RANK=0``; NCCL refuses two ranks on one device). Each bucket travels through a pinned host copy
(``lightning_dp/comm/transports/staging.py``): the ring and the codecs on CUDA tensors, where the exchange path waits
for the device, the feature matrix (dedicated servers included), every drop-in case (dedicated servers resuming from
``ddp``'s GPU checkpoint too) and the codecs under Lightning, each against Lightning's
``DDPStrategy(process_group_backend="gloo")`` on the same device or one process on the global batch.

Two GPUs (``nccl``): NCCL, one rank per GPU, the same matrix and cases, where the communication thread runs on its own
CUDA stream behind events recorded on the streams that produced the gradients, Lightning's collectives use a second
NCCL communicator, and a rank on GPU 1 must never create a context on GPU 0.

The groups ``benchmarks.gpu_check`` runs one after the other (``-k``): :data:`GROUPS`. Lightning launches run at
most :data:`LAUNCH_SLOTS` at a time. ``LIGHTNING_DP_GPU_TIER_ACCELERATOR=cpu`` runs the one-GPU tier with CPU ranks
instead (``gpu_check --accelerator cpu``: a stand-in that checks the launches and measures their time, not a GPU
result).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm import ring_allreduce
from tests.comm.test_syncs import exchange_path_sites
from tests.helpers import replicas
from tests.helpers.devices import tensors_in
from tests.helpers.distributed import run_distributed
from tests.helpers.launch import BATCH, STEPS, load_ranks, run_script
from tests.helpers.runs import STRATEGIES, WITH_SERVERS, DropInRuns, FeatureRuns, assert_follows_ddp
from tests.helpers.syncs import HostReads, cuda_syncs, describe, marked
from tests.scripts.models import reference_training

pytestmark = [pytest.mark.multiprocess, pytest.mark.gpu]
#: ``cpu``: the one-GPU tier's stand-in on CPU ranks (see the module docstring)
ACCELERATOR = os.environ.get("LIGHTNING_DP_GPU_TIER_ACCELERATOR", "gpu")
STAND_IN = ACCELERATOR == "cpu"
ONE_GPU = pytest.mark.skipif(not (torch.cuda.is_available() or STAND_IN), reason="needs a CUDA device")
REAL_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (no CPU stand-in)")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least two CUDA devices for NCCL")
#: a GPU's first torch.compile of a backward can keep one rank away from its peer for minutes
TIMEOUT = {"LIGHTNING_DP_TEST_TIMEOUT": "300"}
#: two single-device nodes on one GPU, every strategy (ddp included) over gloo
SHARED_GPU = {
    "LIGHTNING_DP_TEST_ACCELERATOR": ACCELERATOR,
    "LIGHTNING_DP_TEST_BACKEND": "gloo",
    "LIGHTNING_DP_TEST_NODES": "2",
    **TIMEOUT,
}
#: one rank per GPU, NCCL (the default on CUDA)
NCCL = {"LIGHTNING_DP_TEST_ACCELERATOR": "gpu", **TIMEOUT}
#: cuBLAS kernels are not bitwise reproducible across processes' streams, and NCCL sums in its own order
GPU_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
TIERS = {"shared_gpu": (SHARED_GPU, ONE_GPU), "nccl": (NCCL, TWO_GPUS)}
#: the backend of each tier's collective tests (both ranks on GPU 0 under gloo, rank r on GPU r under NCCL)
BACKENDS = {"shared_gpu": "gloo", "nccl": "nccl"}
#: the codecs under Lightning, two ranks sharing one GPU: (strategy, compression)
CODEC_RUNS = [("ring_allreduce", "bf16"), ("parameter_server", "fp16"), ("sharded_ps", "powersgd")]
POWERSGD_WARMUP = 2
#: the groups of tests ``benchmarks.gpu_check`` runs one after the other: name -> ``pytest -k`` expression
GROUPS = {
    "collectives": "cuda_tensors or synchronizes or context or tensor_cores",
    "features": "feature_matrix",
    "dropin": "drop_in or 16_bit or gpu_checkpoint",
    "codecs": "compression",
}
#: Lightning launches (two ranks each, two more processes for dedicated servers) running at once: a rank keeps about
#: two cores busy (its training and communication threads); ``LIGHTNING_DP_GPU_TIER_SLOTS`` sets another number
LAUNCH_SLOTS = int(os.environ.get("LIGHTNING_DP_GPU_TIER_SLOTS") or max(1, (os.cpu_count() or 2) // 4))


def _tiers():
    return [pytest.param(name, marks=mark) for name, (_, mark) in TIERS.items()]


def _runnable(tier: str) -> bool:
    if tier == "shared_gpu":
        return STAND_IN or torch.cuda.is_available()
    return torch.cuda.device_count() >= 2


def _device() -> torch.device:
    """This rank's device in a collective test: its GPU (``cuda:r`` under NCCL, ``cuda:0`` shared), or the CPU in the
    stand-in."""
    return torch.device("cpu") if STAND_IN else torch.device("cuda", torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------------- collectives
def _ring_on_cuda(rank, world_size):
    device = _device()
    generator = torch.Generator(device=device).manual_seed(rank)  # every rank adds something else
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in (0, 1, 7, 1_000_003):
            x = torch.randint(-8, 9, (numel,), device=device, generator=generator).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            ring_allreduce(x, op="sum")
            assert x.device == device
            assert torch.equal(x, expected), (dtype, numel)
    return True


@pytest.mark.parametrize("tier", _tiers())
def test_ring_allreduce_of_cuda_tensors(tier):
    assert all(run_distributed(_ring_on_cuda, 2, backend=BACKENDS[tier], timeout=180))


def _codecs_on_cuda(rank, world_size):
    from torch import nn

    from lightning_dp.comm.buckets import BucketReducer
    from lightning_dp.comm.codecs import make_codec
    from lightning_dp.comm.transports import CentralServerTransport, RingTransport, ShardedServerTransport
    from lightning_dp.comm.transports.staging import HostStaging

    device = _device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 32)).to(device)
    staged = dist.get_backend() == "gloo" and device.type == "cuda"
    for transport_kind in (RingTransport, ShardedServerTransport, lambda: CentralServerTransport(0)):
        for name, tolerance in (("bf16", 2e-2), ("fp16", 4e-3), ("powersgd", None)):
            reducer = BucketReducer(model.parameters(), lambda b: None)
            transport = transport_kind()
            transport.bind(reducer.buckets)
            assert isinstance(transport.staging, HostStaging) == staged
            codec = make_codec(name, powersgd_warmup_steps=0)
            codec.bind(reducer.buckets, transport)
            generator = torch.Generator(device=device).manual_seed(rank)
            for bucket in reducer.buckets:
                for i, p in enumerate(bucket.params):
                    bucket.fill(i, torch.randn(p.shape, device=device, generator=generator))
                exact = bucket.buffer[: bucket.grad_numel].clone()
                dist.all_reduce(exact)
                exact /= world_size
                codec.reduce(bucket, transport)
                codec.share(bucket, transport)
                got = bucket.buffer[: bucket.grad_numel]
                assert got.device == device
                gathered = [torch.empty_like(got) for _ in range(world_size)]
                dist.all_gather(gathered, got)
                assert all(torch.equal(g, gathered[0]) for g in gathered), (transport, name)
                if tolerance is not None:
                    assert (got - exact).abs().max().item() <= tolerance * exact.abs().max().item(), name
            reducer.close()
    return True


@pytest.mark.parametrize("tier", _tiers())
def test_codecs_on_cuda_tensors_keep_replicas_identical(tier):
    assert all(run_distributed(_codecs_on_cuda, 2, backend=BACKENDS[tier], timeout=180))


def _synchronizations(rank, world_size):
    """Every synchronization of the exchange path (``tests/comm/test_syncs.py``'s steps) on this rank's device, as the
    lines they came from."""
    device = _device()
    if device.type == "cpu":  # the stand-in: host reads of tensor values stand for synchronizations
        return exchange_path_sites(device, HostReads)
    # set_sync_debug_mode is process-wide: the step's recorder also sees the communication thread's exchanges
    return exchange_path_sites(device, cuda_syncs, lambda sites: nullcontext())


@pytest.mark.parametrize("tier", _tiers())
def test_the_exchange_path_synchronizes_only_where_the_guide_says(tier):
    """``torch.cuda.set_sync_debug_mode("warn")`` over a few steps of every transport and codec: each synchronizing
    call comes from a line marked ``# sync:`` (listed in ``docs/gpus.md``), at most as often per step as listed."""
    from tests.comm.test_syncs import STEPS as MEASURED_STEPS
    from tests.comm.test_syncs import _function_of

    for rank, found in enumerate(run_distributed(_synchronizations, 2, backend=BACKENDS[tier], timeout=300)):
        for key, sites in found.items():
            unmarked = [describe(site) for site in sites if not marked(site)]
            assert not unmarked, f"rank {rank}, {key}: synchronizations without a '# sync:' reason: {unmarked}"
            # any_rank: under NCCL the vote's copy to the device and its verdict's back; over gloo none
            per_step = {"read_used": 2 if key.startswith("sharded") else 1, "first_nonfinite": 1,
                        "any_rank": 2 if tier == "nccl" else 0}  # fmt: skip
            counts: dict[str, int] = {}
            for site in sites:
                counts[_function_of(site)] = counts.get(_function_of(site), 0) + 1
            over = {f: n for f, n in counts.items() if n > per_step.get(f, 0) * MEASURED_STEPS}
            assert not over, f"rank {rank}, {key}: more synchronizations than the guide lists: {over}"


def _device_time(rank, world_size):
    """The reducer's time on a GPU is the device's: positive for real exchanges, the exposed part no larger."""
    from torch import nn

    from lightning_dp.comm.buckets import BucketReducer
    from lightning_dp.comm.transports import RingTransport

    device = _device()
    model = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256)).to(device)
    transport = RingTransport()
    reducer = BucketReducer(model.parameters(), transport.reduce, bucket_cap_mb=0.5, device=device)
    transport.bind(reducer.buckets)
    reducer.take_timing()
    for _ in range(3):
        model(torch.randn(64, 256, device=device)).square().mean().backward()
        reducer.finish()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds, exposed, _ = reducer.take_timing()
    reducer.close()
    assert 0.0 < seconds < 60.0 and 0.0 <= exposed, (seconds, exposed)
    return True


@pytest.mark.parametrize("tier", _tiers())
def test_the_exchange_time_of_cuda_tensors_is_the_devices(tier):
    assert all(run_distributed(_device_time, 2, backend=BACKENDS[tier], timeout=120))


def _primary_context_active(device_index: int) -> bool:
    """Whether this process holds the primary CUDA context of GPU ``device_index`` (the driver's own record)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(device), device_index) == 0
    assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)


def _contexts(rank, world_size):
    exchange_path_sites(_device(), lambda sites: nullcontext(), lambda sites: nullcontext())
    return [_primary_context_active(d) for d in range(torch.cuda.device_count())]


@TWO_GPUS
def test_a_rank_creates_no_context_on_another_ranks_gpu():
    """Rank 1 runs on GPU 1: its communication thread, streams and events never create a context on GPU 0 (half a
    GiB per rank, and an error where GPUs run in exclusive-process mode)."""
    contexts = run_distributed(_contexts, 2, backend="nccl", timeout=180)
    for rank, active in enumerate(contexts):
        assert active[rank] and not any(a for d, a in enumerate(active) if d != rank), (rank, active)


@REAL_GPU
def test_powersgd_factors_stay_orthonormal_on_tensor_cores():
    """Under ``set_float32_matmul_precision("high")`` float32 matrix products run in TF32 (checked below): PowerSGD's
    Gram-Schmidt keeps its factors orthonormal all the same."""
    from lightning_dp.comm.codecs.powersgd import _orthogonalize

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        nearly_one = torch.full((256, 256), 1.0 + 2**-12, device="cuda")
        assert (nearly_one @ torch.eye(256, device="cuda")).eq(1.0).all(), "float32 products did not run in TF32"
        worst = 0.0
        for seed in range(3):
            generator = torch.Generator(device="cuda").manual_seed(seed)
            p = torch.randn(64, 1, device="cuda", generator=generator)
            p = p + 1e-3 * torch.randn(64, 4, device="cuda", generator=generator)
            _orthogonalize(p)
            gram = p.double().t() @ p.double()
            worst = max(worst, (gram - torch.eye(4, dtype=torch.float64, device="cuda")).abs().max().item())
    finally:
        torch.set_float32_matmul_precision(previous)
    assert worst < 1e-5, worst


# ---------------------------------------------------------------------------------------------------- under Lightning
@pytest.fixture(scope="module")
def feature_runs(tmp_path_factory):
    """The feature matrix's launches of every tier that can run here, started when the first test asks."""
    runs = {}
    for name, (env, _) in TIERS.items():
        runs[name] = FeatureRuns(tmp_path_factory.mktemp(f"features-{name}"), env=env)
        if _runnable(name):
            runs[name].start(["ddp", *STRATEGIES, WITH_SERVERS], slots=LAUNCH_SLOTS)
    return runs


@pytest.fixture(scope="module")
def dropin_runs(tmp_path_factory):
    """The drop-in launches (``ddp`` first: the others resume from its checkpoint), started when the first test asks."""
    runs = {}
    for name, (env, _) in TIERS.items():
        runs[name] = DropInRuns(tmp_path_factory.mktemp(f"dropin-{name}"), env=env)
        if _runnable(name):
            runs[name].start([*STRATEGIES, WITH_SERVERS], slots=LAUNCH_SLOTS)
    return runs


def _fit_with_codec(out, strategy: str, compression: str) -> list[dict]:
    # PowerSGD of rank 1: at its default rank 4 no matrix of the model would be compressed
    run_script("fit", "--strategy", strategy, "--devices", "2", "--batch-size", str(BATCH), "--steps", str(STEPS),
               "--compression", compression, "--powersgd-rank", "1", "--powersgd-warmup", str(POWERSGD_WARMUP),
               "--out", str(out), timeout=300, env=SHARED_GPU)  # fmt: skip
    return load_ranks(out, 2)


def _started_on_shared_gpu(launches: dict) -> dict:
    """Every launch (key -> a function running it) on the shared GPU at once, at most :data:`LAUNCH_SLOTS` together:
    their futures by key (none where that tier cannot run)."""
    if not _runnable("shared_gpu"):
        return {}
    pool = ThreadPoolExecutor(max_workers=min(len(launches), LAUNCH_SLOTS))
    runs = {key: pool.submit(launch) for key, launch in launches.items()}
    pool.shutdown(wait=False)
    return runs


@pytest.fixture(scope="module")
def codec_runs(tmp_path_factory):
    """Each codec under Lightning on the shared GPU, started when the first test asks."""
    return _started_on_shared_gpu(
        {run: partial(_fit_with_codec, tmp_path_factory.mktemp("-".join(run)), *run) for run in CODEC_RUNS}
    )


@pytest.mark.slow
@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("strategy", [*STRATEGIES, WITH_SERVERS])
def test_feature_matrix_on_gpus_follows_ddp(feature_runs, tier, strategy, monkeypatch):
    monkeypatch.setattr(replicas, "TOLERANCE", GPU_TOLERANCE)
    runs = feature_runs[tier]
    ranks, ddp = runs.main(strategy), runs.main("ddp")
    for key in ("weights", "bf16_weights", "bn_weights"):
        replicas.assert_replicas_follow(ranks, key, ddp[0][key], f"{key} vs ddp ({tier})")
    for rank in range(2):
        assert ranks[rank]["seen"] == ddp[rank]["seen"] and ranks[rank]["epochs"] == ddp[rank]["epochs"]


@pytest.mark.slow
@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "case", ["hooks", "add_group", "compiled", "compiled_submodule", "reentrant", "syncbn", "resume"]
)
def test_drop_in_cases_on_gpus_follow_ddp(dropin_runs, tier, strategy, case):
    if case == "syncbn" and STAND_IN:
        pytest.skip("SyncBatchNorm needs GPUs (the CPU stand-in runs no syncbn case)")
    assert_follows_ddp(dropin_runs[tier], strategy, case, GPU_TOLERANCE)


#: the servers whose weight pull runs behind the next forward, each launched once (two ranks sharing one GPU)
PULL_RUNS = ("parameter_server", "sharded_ps")


def _pull_overlap(out, strategy: str) -> list[dict]:
    run_script("pull_overlap", "--strategy", strategy, "--devices", "2", "--intra-node", "ring", "--out", str(out),
               timeout=300, env=SHARED_GPU)  # fmt: skip
    return load_ranks(out, 2)


@pytest.fixture(scope="module")
def pull_runs(tmp_path_factory):
    """``tests/scripts/pull_overlap.py`` for each server on the shared GPU, both launched when the first test asks."""
    return _started_on_shared_gpu(
        {name: partial(_pull_overlap, tmp_path_factory.mktemp(f"pull-{name}"), name) for name in PULL_RUNS}
    )


@ONE_GPU
@pytest.mark.slow
@pytest.mark.parametrize("strategy", PULL_RUNS)
def test_drop_in_pull_behind_the_forward_sharing_one_gpu_equals_the_blocking_pull(pull_runs, strategy):
    """The servers' weight pull behind the next forward on CUDA buckets over gloo (pinned host copies, the
    communication stream, one event per bucket) reads exactly the weights of the pull at the end of the step
    (``tests/scripts/pull_overlap.py``; the CPU version is ``tests/strategies/test_pull_overlap.py``)."""
    ranks = pull_runs[strategy].result()
    assert ranks[1]["overlapped"]["report"]["waited_in_forward"] > 0  # not the central server: it takes every bucket
    for rank in ranks:
        overlapped, blocking = rank["overlapped"], rank["blocking"]
        assert overlapped["report"]["mode"] == "OverlappedPull"
        assert overlapped["losses"] == blocking["losses"] and len(overlapped["seen"]) == len(blocking["seen"]) > 0
        for seen, theirs in zip(overlapped["seen"], blocking["seen"], strict=True):
            assert torch.equal(seen, theirs)
        assert torch.equal(overlapped["final"], blocking["final"])


@pytest.mark.slow
@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_16_bit_cases_on_gpus_follow_ddp(dropin_runs, tier, strategy):
    assert_follows_ddp(dropin_runs[tier], strategy, "fp16", dict(rtol=2e-3, atol=2e-3))
    assert_follows_ddp(dropin_runs[tier], strategy, "bf16", dict(rtol=1e-2, atol=1e-2))


@pytest.mark.slow
@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("strategy", ["sharded_ps", WITH_SERVERS])
def test_sharded_state_resumes_from_a_gpu_checkpoint_and_is_saved_in_host_memory(dropin_runs, tier, strategy):
    """``ddp``'s checkpoint holds its AdamW state on the GPU: the dedicated servers (CPU processes) and the trainers
    take their shares of it and continue ``ddp``'s steps; the state a checkpoint then gathers from the shards is in
    host memory, never rebuilt whole on trainer 0's GPU."""
    assert_follows_ddp(dropin_runs[tier], strategy, "resume", GPU_TOLERANCE)
    saved = torch.load(dropin_runs[tier].root / strategy / "resume" / "final.ckpt", weights_only=False)
    [state] = saved["optimizer_states"]
    tensors = tensors_in(state["state"])
    assert len(tensors) >= 3 * 6  # step, exp_avg, exp_avg_sq of every parameter
    assert all(t.device.type == "cpu" for t in tensors), sorted({str(t.device) for t in tensors})


@ONE_GPU
@pytest.mark.slow
@pytest.mark.parametrize("strategy, compression", CODEC_RUNS)
def test_compression_sharing_one_gpu_follows_one_process(codec_runs, strategy, compression):
    """Each codec under Lightning, buckets staged through host memory: replicas bit-identical, and the weights
    within the codec's error of one process on the global batch (PowerSGD: exact during its warm-up, then not)."""
    ranks = codec_runs[(strategy, compression)].result()
    assert ranks[0]["codec"] == compression and ranks[0]["world_size"] == 2
    replicas.assert_identical_replicas(ranks)
    reference = reference_training(BATCH * 2, STEPS, "sgd")
    assert len(ranks[0]["weights"]) == len(reference) == STEPS
    if compression == "powersgd":
        for step in range(POWERSGD_WARMUP):
            torch.testing.assert_close(ranks[0]["weights"][step], reference[step], **GPU_TOLERANCE)
        assert not torch.allclose(ranks[0]["weights"][-1], reference[-1], **GPU_TOLERANCE), (
            "PowerSGD compressed nothing"
        )
    else:
        # with error feedback a 16-bit run stays within a few roundings of one step (2^-8 of it for bf16): far below
        # a twentieth of what the last steps moved the weights, which a rank training on its own batch, or a step
        # lost, exceeds
        moved = (reference[-1] - reference[0]).abs().max().item()
        for step, (got, want) in enumerate(zip(ranks[0]["weights"], reference, strict=True)):
            torch.testing.assert_close(got, want, rtol=0, atol=moved / 20, msg=f"step {step + 1}")
    assert not torch.equal(ranks[0]["weights"][0], ranks[0]["weights"][-1])
