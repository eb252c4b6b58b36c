"""The gloo rendezvous across hosts: rank 0 opens the store on its own host (port 0 = a free one
it picks itself, every interface) and reports the address the other ranks dial; a worker's
--advertise-host / --comm-port replace the host and port the gateway names."""

from __future__ import annotations

import threading

import pytest
import torch
from shardlm.errors import InvalidArgumentError

from worker.comm import GlooCommunicator, open_store
from worker.comm.gloo import format_address, parse_address
from worker.worker_servicer import WorkerServicer


def test_rank0_opens_the_store_on_a_free_port_and_the_others_meet_it_there():
    store, address = open_store("127.0.0.1:0", 2, timeout_s=20)
    host, port = parse_address(address)
    assert host == "127.0.0.1" and port > 0
    sums: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            comm = GlooCommunicator(r, 2, init_address=address, timeout_s=20,
                                    store=store if r == 0 else None)
            t = torch.full((2,), float(r + 1))
            comm.all_reduce(t)
            sums[r] = t.tolist()
            comm.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sums == {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_only_rank0_serves_the_store():
    store, address = open_store("127.0.0.1:0", 2, timeout_s=5)
    with pytest.raises(ValueError, match="only rank 0"):
        GlooCommunicator(1, 2, init_address=address, store=store)


def test_addresses_keep_ipv6_in_brackets():
    assert format_address("::1", 29500) == "[::1]:29500"
    assert parse_address("[::1]:0", allow_port_zero=True) == ("::1", 0)
    with pytest.raises(ValueError):
        parse_address("10.0.0.1:0")  # port 0 only where a store is about to be opened


def test_advertise_host_and_comm_port_replace_what_the_gateway_names():
    assert WorkerServicer()._rendezvous_address("10.0.0.1:0") == "10.0.0.1:0"
    assert WorkerServicer("node-a.internal", 29500)._rendezvous_address(
        "10.0.0.1:0") == "node-a.internal:29500"
    assert WorkerServicer(comm_port=29500)._rendezvous_address("10.0.0.1:0") == "10.0.0.1:29500"
    with pytest.raises(InvalidArgumentError) as err:
        WorkerServicer()._rendezvous_address("no-port")
    assert [v.field for v in err.value.field_violations] == ["comm.init_address"]
