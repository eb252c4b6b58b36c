"""KV events end to end: two ShardLM replicas behind two `smg launch` routers with the
cache-aware policy (a highly available deployment), on loopback. Both routers learn each
replica's prefix cache from its events (stored, removed when the cache evicts, cleared on
ResetCache), so a prompt whose prefix a replica holds goes there whichever router it reaches;
and a SIGTERM'd replica finishes its streams while the routers stop sending it new ones. The
publisher's own contract (resume from a sequence number, snapshots, DATA_LOSS) is tested with a
plain subscriber in tests/gateway/api/test_smg_service.py. Skipped where `smg` is not installed.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from bench.serve_process import metric_sum, parse_prometheus
from tests.gateway.smg_fixtures import SMG, chat_checkpoint, free_port, loaded_gateway, smg_router
from tests.gateway.test_serve import start_serve

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router (PyPI smg) is not installed")

HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1")
SYSTEMS = [" ".join(f"{word}{i}" for i in range(60)) for word in ("alpha", "brook", "cedar")]


def chat(base: str, model: str, system: str, question: str, max_tokens: int = 4,
         **extra) -> dict:
    body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": question}], **extra}).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def router_metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return parse_prometheus(reply.read().decode())


def eventually(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("kv-events-llama"))


@pytest.fixture(scope="module")
def replicas(model):
    gateways = [loaded_gateway(model) for _ in range(2)]
    yield gateways
    for gateway in gateways:
        gateway.close()


@contextlib.contextmanager
def two_routers(replicas, tmp_path, *extra: str):
    workers = [f"grpc://{g.address}" for g in replicas]
    ports = [free_port(), free_port()]
    with contextlib.ExitStack() as stack:
        ups = [stack.enter_context(smg_router(workers, tmp_path / f"smg{i}.log", "--policy",
                                              "cache_aware", *extra, metrics_port=port))
               for i, port in enumerate(ports)]
        yield [(base, model, port) for (base, model), port in zip(ups, ports, strict=True)]


def test_both_routers_route_each_prefix_to_the_replica_that_holds_it(replicas, tmp_path):
    with two_routers(replicas, tmp_path) as routers:
        cached = []
        for turn in range(4):
            for system in SYSTEMS:  # alternating routers: each sees half of every prompt's turns
                base, model, _ = routers[len(cached) % 2]
                usage = chat(base, model, system, f"question {turn}")["usage"]
                cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        assert cached[:3] == [0, 0, 0]
        # Every later turn reuses its system prompt, though half of them reach the router that
        # did not route the first one: it learned where the prefix lives from the events.
        assert all(c > 0 for c in cached[3:]), cached
        for _, _, port in routers:
            m = router_metrics(port)
            assert metric_sum(m, "smg_kv_event_blocks_total", op="stored") > 0
            assert metric_sum(m, "smg_cache_aware_policy_branch_total", branch="event_hit") > 0
        # ResetCache clears what the routers know of each replica.
        for replica in replicas:
            replica.stub.ResetCache(gateway_pb2.ResetCacheRequest(all=True))
        for _, _, port in routers:
            eventually(lambda p=port: metric_sum(router_metrics(p), "smg_kv_index_blocks") == 0)


def test_evicted_blocks_reach_the_routers_as_removed(replicas, model, tmp_path):
    blocks = 24  # too few for every prompt below: the caches evict
    for replica in replicas:
        for _ in replica.stub.Load(gateway_pb2.LoadRequest(
                model_path=str(model), kv_cache=common_pb2.KvCacheConfig(num_blocks=blocks))):
            pass
    with two_routers(replicas, tmp_path) as routers:
        for i in range(12):
            base, model_id, _ = routers[i % 2]
            chat(base, model_id, " ".join(f"w{i}x{j}" for j in range(40)), "q", max_tokens=2)
        for _, _, port in routers:
            m = router_metrics(port)
            assert metric_sum(m, "smg_kv_event_blocks_total", op="removed") > 0
            # What a router believes a replica holds never exceeds that replica's cache.
            eventually(lambda p=port: all(
                v <= blocks for k, v in router_metrics(p).items()
                if k.startswith("smg_kv_index_blocks{")))


def test_a_sigtermed_replica_finishes_its_streams_and_gets_no_new_ones(model, tmp_path):
    outputs: list[list[str]] = [[], []]
    engine_ports = [free_port(), free_port()]
    procs = [start_serve("--model", str(model), "--dtype", "float32", "--smg-port", str(port),
                         "--drain-announce", "30", output=out)[0]
             for port, out in zip(engine_ports, outputs, strict=True)]
    try:
        workers = [f"grpc://127.0.0.1:{p}" for p in engine_ports]
        with smg_router(workers, tmp_path / "smg.log", "--policy", "round_robin",
                        *HEALTH) as (base, model_id):
            long_calls = []
            with ThreadPoolExecutor(4) as pool:
                for i in range(2):  # round robin: one long stream on each replica
                    long_calls.append(pool.submit(chat, base, model_id, "s", f"long {i}", 400,
                                                  ignore_eos=True))
                time.sleep(0.5)
                procs[0].send_signal(signal.SIGTERM)
                short = [chat(base, model_id, "s", f"short {i}", 2) for i in range(12)
                         if not time.sleep(0.25)]
                finished = [call.result(timeout=120) for call in long_calls]
        assert all(r["choices"][0]["message"] is not None for r in short)
        assert [r["usage"]["completion_tokens"] for r in finished] == [400, 400]
        assert procs[0].wait(60) == 0
        drained = [line for line in outputs[0] if line.startswith("drained: ")]
        assert len(drained) == 1 and drained[0].endswith(" 0 refused after\n"), outputs[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
