"""The GPU tiers (skipped without CUDA; ``python -m benchmarks.gpu_check`` runs them and reports).

One GPU: two ranks share it over gloo, started as two single-device nodes (Lightning's general-purpose cluster
recipe: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE=2``, ``NODE_RANK``, ``LOCAL_RANK=0``; NCCL refuses two ranks
on one device). Each bucket travels through a pinned host copy (``lightning_dp/comm/transports/staging.py``): the
ring and the codecs on CUDA tensors, the feature matrix (dedicated servers included), every drop-in case and the codecs
under Lightning, each against Lightning's ``DDPStrategy(process_group_backend="gloo")`` on the same device or one
process on the global batch.

Two GPUs: NCCL, one rank per GPU, the same matrix and cases, where the communication thread runs on its own CUDA
stream behind events recorded on the streams that produced the gradients, and Lightning's collectives use a
second NCCL communicator.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from lightning_dp.comm import ring_allreduce
from tests.helpers import replicas
from tests.helpers.distributed import run_distributed
from tests.helpers.launch import BATCH, STEPS, load_ranks, run_script
from tests.helpers.runs import STRATEGIES, WITH_SERVERS, DropInRuns, FeatureRuns, assert_follows_ddp
from tests.scripts.models import reference_training

pytestmark = [pytest.mark.multiprocess, pytest.mark.gpu]
ONE_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least two CUDA devices for NCCL")
#: two single-device nodes on one GPU, every strategy (ddp included) over gloo
SHARED_GPU = {
    "LIGHTNING_DP_TEST_ACCELERATOR": "gpu",
    "LIGHTNING_DP_TEST_BACKEND": "gloo",
    "LIGHTNING_DP_TEST_NODES": "2",
}
#: one rank per GPU, NCCL (the default on CUDA)
NCCL = {"LIGHTNING_DP_TEST_ACCELERATOR": "gpu"}
#: cuBLAS kernels are not bitwise reproducible across processes' streams, and NCCL sums in its own order
GPU_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
TIERS = {"shared_gpu": (SHARED_GPU, ONE_GPU), "nccl": (NCCL, TWO_GPUS)}
#: the backend of each tier's collective tests (both ranks on GPU 0 under gloo, rank r on GPU r under NCCL)
BACKENDS = {"shared_gpu": "gloo", "nccl": "nccl"}
#: the codecs under Lightning, two ranks sharing one GPU: (strategy, compression)
CODEC_RUNS = [("ring_allreduce", "bf16"), ("parameter_server", "fp16"), ("sharded_ps", "powersgd")]
POWERSGD_WARMUP = 2


def _tiers():
    return [pytest.param(name, marks=mark) for name, (_, mark) in TIERS.items()]


def _runnable(tier: str) -> bool:
    return torch.cuda.device_count() >= (1 if tier == "shared_gpu" else 2)


def _fit_with_codec(out, strategy: str, compression: str) -> list[dict]:
    # PowerSGD of rank 1: at its default rank 4 no matrix of the model would be compressed
    run_script("fit", "--strategy", strategy, "--devices", "2", "--batch-size", str(BATCH), "--steps", str(STEPS),
               "--compression", compression, "--powersgd-rank", "1", "--powersgd-warmup", str(POWERSGD_WARMUP),
               "--out", str(out), timeout=300, env=SHARED_GPU)  # fmt: skip
    return load_ranks(out, 2)


@pytest.fixture(scope="module", autouse=True)
def launches(tmp_path_factory):
    """Every Lightning launch of the tiers that can run here, started at once when the module begins (a GPU machine
    has cores to spare; one after the other they would take many minutes); each test waits for the runs it reads."""
    features, dropin = {}, {}
    for name, (env, _) in TIERS.items():
        features[name] = FeatureRuns(tmp_path_factory.mktemp(f"features-{name}"), env=env)
        dropin[name] = DropInRuns(tmp_path_factory.mktemp(f"dropin-{name}"), env=env)
        if _runnable(name):
            features[name].start(["ddp", *STRATEGIES, WITH_SERVERS])
            dropin[name].start(STRATEGIES)
    codecs = {}
    if _runnable("shared_gpu"):
        pool = ThreadPoolExecutor(max_workers=len(CODEC_RUNS))
        codecs = {run: pool.submit(_fit_with_codec, tmp_path_factory.mktemp("-".join(run)), *run) for run in CODEC_RUNS}
        pool.shutdown(wait=False)
    return {"features": features, "dropin": dropin, "codecs": codecs}


# ---------------------------------------------------------------------------------------------------- collectives
def _ring_on_cuda(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
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

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 32)).cuda()
    staged = dist.get_backend() == "gloo"
    for transport_kind in (RingTransport, ShardedServerTransport, lambda: CentralServerTransport(0)):
        for name, tolerance in (("bf16", 2e-2), ("fp16", 4e-3), ("powersgd", None)):
            reducer = BucketReducer(model.parameters(), lambda b: None)
            transport = transport_kind()
            transport.bind(reducer.buckets)
            assert isinstance(transport.staging, HostStaging) == staged
            codec = make_codec(name, powersgd_warmup_steps=0)
            codec.bind(reducer.buckets, transport)
            generator = torch.Generator(device="cuda").manual_seed(rank)
            for bucket in reducer.buckets:
                for i, p in enumerate(bucket.params):
                    bucket.fill(i, torch.randn(p.shape, device="cuda", generator=generator))
                exact = bucket.buffer[: bucket.grad_numel].clone()
                dist.all_reduce(exact)
                exact /= world_size
                codec.reduce(bucket, transport)
                codec.share(bucket, transport)
                got = bucket.buffer[: bucket.grad_numel]
                assert got.is_cuda
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


# ---------------------------------------------------------------------------------------------------- under Lightning
@pytest.fixture(scope="module")
def feature_runs(launches):
    return launches["features"]


@pytest.fixture(scope="module")
def dropin_runs(launches):
    return launches["dropin"]


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
    assert_follows_ddp(dropin_runs[tier], strategy, case, GPU_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_16_bit_cases_on_gpus_follow_ddp(dropin_runs, tier, strategy):
    assert_follows_ddp(dropin_runs[tier], strategy, "fp16", dict(rtol=2e-3, atol=2e-3))
    assert_follows_ddp(dropin_runs[tier], strategy, "bf16", dict(rtol=1e-2, atol=1e-2))


@ONE_GPU
@pytest.mark.slow
@pytest.mark.parametrize("strategy, compression", CODEC_RUNS)
def test_compression_sharing_one_gpu_follows_one_process(launches, strategy, compression):
    """Each codec under Lightning, buckets staged through host memory: replicas bit-identical, and the weights
    within the codec's error of one process on the global batch (PowerSGD: exact during its warm-up, then not)."""
    ranks = launches["codecs"][(strategy, compression)].result()
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
        for step, (got, want) in enumerate(zip(ranks[0]["weights"], reference)):
            torch.testing.assert_close(got, want, rtol=0, atol=moved / 20, msg=f"step {step + 1}")
    assert not torch.equal(ranks[0]["weights"][0], ranks[0]["weights"][-1])
