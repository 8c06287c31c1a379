"""Transport errors are recognised and the lost rank is found behind the address gloo prints."""

import pytest
import torch.distributed as dist

from lightning_dp.comm.cluster.peers import PeerDirectory, is_transport_error
from lightning_dp.comm.errors import PeerUnreachableError

pytestmark = pytest.mark.unit


def test_peer_directory_finds_ranks_behind_printed_addresses():
    directory = PeerDirectory({"127.0.0.1:48404": 2, "10.77.0.2:35000": 1})
    assert directory.rank_in("Connection closed by peer [127.0.0.1]:48404") == 2
    # gloo prints some ports in network byte order: 48404 = 0xBD14 appears as 0x14BD = 5309
    assert directory.rank_in("pair.cc:561] Connection closed by peer [127.0.0.1]:5309. This is") == 2
    assert directory.rank_in("Read error [::ffff:10.77.0.2]:35000: Connection reset by peer") == 1
    assert directory.rank_in("Connection closed by peer [127.0.0.1]:1") is None
    assert directory.rank_in("no address here") is None
    assert directory.rank_in("Connection closed by peer [127.0.0.1]:48404", exclude=2) is None  # never oneself


def test_transport_errors_are_told_apart_from_bugs():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:2465: Connection reset by peer")
    assert is_transport_error(gloo)
    assert is_transport_error(RuntimeError("Timed out waiting 10000ms for recv operation to complete"))
    assert not is_transport_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"))
    assert not is_transport_error(ValueError("Connection reset"))
    assert not is_transport_error(PeerUnreachableError("rank 0 could not reach rank 1"))  # already named
    # a local NCCL failure is not a lost peer
    nccl_oom = dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp, unhandled cuda error, NCCL version "
        "2.30.7\nncclUnhandledCudaError: Call to CUDA function failed. out of memory"
    )
    assert not is_transport_error(nccl_oom)
    assert is_transport_error(dist.DistNetworkError("failed to connect to 10.77.0.1:29500"))
    # NCCL's watchdog ending a collective whose peer is gone
    watchdog = (
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=SEND, "
        "Timeout(ms)=600000) ran for 600012 milliseconds before timing out."
    )
    assert is_transport_error(dist.DistBackendError(watchdog))
