"""`shardlm serve`: workers + gateway in one command, with a graceful shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from pathlib import Path

from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError

from gateway.auth import load_tokens
from gateway.config import ServeConfig
from gateway.server import server_credentials, start_gateway
from gateway.supervisor import Supervisor
from worker.launcher import WorkerGroup, WorkerTLS

log = logging.getLogger("shardlm.serve")
# The demo model trained by scripts/train_demo_model.py, served when no --model is given.
BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "models" / "shakespeare-tiny"


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _start_workers(cfg: ServeConfig) -> WorkerGroup:
    tls = None
    if cfg.worker_tls_ca:  # validated: the three files come together
        tls = WorkerTLS(cfg.worker_tls_ca, cfg.worker_tls_cert, cfg.worker_tls_key)
    if cfg.workers:
        group = WorkerGroup.connect(cfg.worker_addresses(),
                                    "cuda" if cfg.device == "cuda" else "cpu", tls)
        group.wait_healthy(cfg.worker_start_timeout)
        return group
    device = cfg.device or ("cuda" if _cuda_available() else "cpu")
    devices = cfg.device_ids()
    count = len(devices) if devices else cfg.tp or 1
    return WorkerGroup.spawn(count, device=device, devices=devices, tls=tls,
                             start_timeout_s=cfg.worker_start_timeout)


async def serve(cfg: ServeConfig) -> int:
    from gateway.cli import install_stop_handlers

    if not cfg.model and not cfg.no_model and (BUNDLED_MODEL / "config.json").exists():
        cfg = dataclasses.replace(cfg, model=str(BUNDLED_MODEL))
        print(f"no --model given: serving the bundled demo model {BUNDLED_MODEL.name}", flush=True)

    try:
        group = await asyncio.to_thread(_start_workers, cfg)
    except (ShardLMError, OSError, ValueError) as exc:
        print(f"error: could not start workers: {exc}", file=sys.stderr)
        return 1
    try:
        credentials = None
        if cfg.tls_cert:
            credentials = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        tokens = load_tokens(cfg.auth_tokens) if cfg.auth_tokens else None
        model_root = cfg.model_root
        if model_root is None and tokens and cfg.model:
            model_root = str(Path(cfg.model).resolve().parent)  # auth on: never load anywhere
        server = await start_gateway(group, host=cfg.host, port=cfg.port, limits=cfg.limits,
                                     metrics_port=cfg.metrics_port, credentials=credentials,
                                     auth_tokens=tokens, model_root=model_root,
                                     load_options=cfg.load_options)
    except (OSError, ValueError, TypeError) as exc:
        group.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    supervisor = Supervisor(server.runtime, lambda: _start_workers(cfg))
    supervisor.start()
    address = f"{cfg.host}:{server.port}"
    print(f"ShardLM gateway on {address} with {group.world_size} worker(s)", flush=True)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    if cfg.model:
        def progress(p: common_pb2.LoadProgress) -> None:
            print(f"loading: {p.fraction:4.0%} {p.message}", flush=True)

        try:
            model = await server.runtime.load(cfg.model, cfg.dtype_enum(), 0, cfg.kv_cache(),
                                              progress)
        except ShardLMError as exc:
            print(f"error: could not load {cfg.model}: {exc.message}", file=sys.stderr)
            await supervisor.stop()
            await server.drain(0)
            server.runtime.group.close()
            return 1
        print(f"ready: serving {model.info.architecture} from {cfg.model} on {address}",
              flush=True)
    else:
        print("no model: waiting for a Load call (health is NOT_SERVING until then)", flush=True)
    await stop.wait()
    print("draining...", flush=True)
    await supervisor.stop()
    await server.drain(cfg.drain_grace)
    await asyncio.to_thread(server.runtime.group.close)
    print("stopped", flush=True)
    return 0
