"""`shardlm serve`: workers + gateway in one command, with a graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError

from gateway.auth import load_tokens
from gateway.default_model import DefaultModelMissing, default_model_path
from gateway.runtime import Limits
from gateway.server import server_credentials, start_gateway
from gateway.supervisor import Supervisor
from worker.launcher import WorkerGroup, WorkerTLS

log = logging.getLogger("shardlm.serve")
DTYPE_ENUMS = {"float32": common_pb2.DTYPE_FLOAT32, "bfloat16": common_pb2.DTYPE_BFLOAT16,
               "float16": common_pb2.DTYPE_FLOAT16}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _start_workers(s: dict) -> WorkerGroup:
    tls = None
    if s["worker_tls_ca"] or s["worker_tls_cert"] or s["worker_tls_key"]:
        if not (s["worker_tls_ca"] and s["worker_tls_cert"] and s["worker_tls_key"]):
            raise ValueError("--worker-tls-ca, --worker-tls-cert and --worker-tls-key go together")
        tls = WorkerTLS(s["worker_tls_ca"], s["worker_tls_cert"], s["worker_tls_key"])
    if s["workers"]:
        addresses = [a.strip() for a in str(s["workers"]).split(",") if a.strip()]
        group = WorkerGroup.connect(addresses, "cuda" if s["device"] == "cuda" else "cpu", tls)
        group.wait_healthy(60)
        return group
    device = s["device"] or ("cuda" if _cuda_available() else "cpu")
    devices = [int(d) for d in str(s["devices"]).split(",")] if s["devices"] else None
    count = len(devices) if devices else int(s["tp"] or 1)
    return WorkerGroup.spawn(count, device=device, devices=devices, tls=tls)


async def serve(s: dict) -> int:
    from gateway.cli import install_stop_handlers

    if not s["model"] and not s["no_model"]:
        try:
            s["model"] = str(default_model_path())
        except DefaultModelMissing as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"no --model given: serving the default model {Path(s['model']).name}", flush=True)

    try:
        group = await asyncio.to_thread(_start_workers, s)
    except (ShardLMError, OSError, ValueError) as exc:
        print(f"error: could not start workers: {exc}", file=sys.stderr)
        return 1
    group.quantize = s["quantize"] or ""
    limits = Limits(max_new_tokens=int(s["max_new_tokens"]),
                    session_idle_timeout_s=float(s["session_idle_timeout"]))
    try:
        credentials = None
        if s["tls_cert"] or s["tls_key"]:
            credentials = server_credentials(s["tls_cert"], s["tls_key"], s["tls_client_ca"])
        tokens = load_tokens(s["auth_tokens"]) if s["auth_tokens"] else None
        model_root = s["model_root"]
        if model_root is None and tokens and s["model"]:
            model_root = str(Path(s["model"]).resolve().parent)  # auth on: never load anywhere
        server = await start_gateway(group, host=s["host"], port=int(s["port"]), limits=limits,
                                     metrics_port=s["metrics_port"], credentials=credentials,
                                     auth_tokens=tokens, model_root=model_root)
    except (OSError, ValueError, TypeError) as exc:
        group.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    supervisor = Supervisor(server.runtime, lambda: _start_workers(s))
    supervisor.start()
    address = f"{s['host']}:{server.port}"
    print(f"ShardLM gateway on {address} with {group.world_size} worker(s)", flush=True)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    if s["model"]:
        kv = common_pb2.KvCacheConfig(block_size=int(s["block_size"]),
                                      memory_bytes=int(s["kv_cache_mb"]) << 20)

        def progress(p: common_pb2.LoadProgress) -> None:
            print(f"loading: {p.fraction:4.0%} {p.message}", flush=True)

        try:
            model = await server.runtime.load(str(s["model"]), DTYPE_ENUMS.get(s["dtype"] or "", 0),
                                              0, kv, progress)
        except ShardLMError as exc:
            print(f"error: could not load {s['model']}: {exc.message}", file=sys.stderr)
            await supervisor.stop()
            await server.drain(0)
            server.runtime.group.close()
            return 1
        print(f"ready: serving {model.info.architecture} from {s['model']} on {address}",
              flush=True)
    else:
        print("no model: waiting for a Load call (health is NOT_SERVING until then)", flush=True)
    await stop.wait()
    print("draining...", flush=True)
    await supervisor.stop()
    await server.drain(float(s["drain_grace"]))
    await asyncio.to_thread(server.runtime.group.close)
    print("stopped", flush=True)
    return 0
