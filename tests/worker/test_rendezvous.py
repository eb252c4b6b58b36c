"""The gloo rendezvous across hosts: rank 0 opens the store on its own host (port 0 = a free one
it picks itself, every interface) and reports the address the other ranks dial; a worker's
--advertise-host / --comm-port replace the host and port the gateway names."""

from __future__ import annotations

import threading

import pytest
import torch
from shardlm.errors import InvalidArgumentError

from shardlm_server.worker.comm import CommunicatorError, GlooCommunicator, open_store
from shardlm_server.worker.comm.gloo import format_address, parse_address
from shardlm_server.worker.worker_servicer import WorkerServicer


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


def test_abort_ends_a_collective_whose_peer_never_comes_and_frees_the_port():
    """Rank 1 never joins rank 0's all_reduce (its request was lost): abort() ends the wait long
    before the 60 s timeout, close() returns at once, and the store's port can be opened again."""
    store, address = open_store("127.0.0.1:0", 2, timeout_s=60)
    comms: dict[int, GlooCommunicator] = {}

    def join(r: int) -> None:
        comms[r] = GlooCommunicator(r, 2, init_address=address, timeout_s=60,
                                    store=store if r == 0 else None)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    store = None  # rank 0 keeps it
    outcome: list[BaseException] = []

    def stuck() -> None:
        try:
            comms[0].all_reduce(torch.ones(4))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    waiter = threading.Thread(target=stuck)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # really waiting for rank 1
    comms[0].abort("a new Load replaces this communicator")
    waiter.join(10)
    assert not waiter.is_alive()
    assert isinstance(outcome[0], CommunicatorError) and "aborted" in str(outcome[0])
    with pytest.raises(CommunicatorError, match="aborted"):
        comms[0].barrier()
    done = threading.Event()
    threading.Thread(target=lambda: (comms[0].close(), done.set()), daemon=True).start()
    assert done.wait(10)  # not held until the pending collective times out
    again, _ = open_store(address, 2, timeout_s=5)  # the same port, at once
    del again
    comms[1].close()
