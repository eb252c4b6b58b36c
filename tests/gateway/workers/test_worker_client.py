"""WorkerPool.load's rendezvous relay: rank 0 is asked to open the gloo store on its own host (port
0: it picks the port, never the gateway, which cannot bind ports on another host), and the other
ranks are sent the address rank 0 reported."""

from __future__ import annotations

import asyncio

import grpc
from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

from shardlm_server.gateway.workers.client import WorkerPool, rendezvous_host

REPORTED = "node-a.internal:29500"


class FakeRank(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self) -> None:
        self.requests: list[worker_pb2.LoadRequest] = []

    async def Load(self, request, context):
        self.requests.append(request)
        if request.rank == 0:
            yield worker_pb2.LoadResponse(comm_init_address=REPORTED)
        yield worker_pb2.LoadResponse(complete=worker_pb2.LoadComplete())


async def _load_on_two_fake_ranks() -> list[FakeRank]:
    ranks, servers, addresses = [FakeRank(), FakeRank()], [], []
    for rank in ranks:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(rank, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    pool = WorkerPool(addresses, step_timeout_s=5)
    try:
        await asyncio.wait_for(pool.load("/models/m"), 30)
    finally:
        await pool.close()
        for server in servers:
            await server.stop(None)
    return ranks


def test_rank0_picks_the_port_and_the_others_dial_what_it_reported():
    rank0, rank1 = asyncio.run(_load_on_two_fake_ranks())
    assert rank0.requests[0].comm.init_address == "127.0.0.1:0"
    assert rank1.requests[0].comm.init_address == REPORTED
    assert rank1.requests[0].comm.backend == worker_pb2.COMM_BACKEND_GLOO


def test_rendezvous_host_is_the_host_the_gateway_dials():
    assert rendezvous_host("10.0.0.7:50061") == "10.0.0.7"
    assert rendezvous_host("[fd00::7]:50061") == "[fd00::7]"
    assert rendezvous_host("unix:/run/shardlm/worker0.sock") == "127.0.0.1"
