"""`shardlm serve`: workers + gateway in one command, with a graceful shutdown.

Start-up goes from cheap to costly: settings and paths, then the gateway's ports (probed, so a
busy port is reported before any worker is started), then the workers, the gateway, the model.
Whatever fails on the way, and a SIGINT / SIGTERM before the model is ready, stops every process
started so far and ends with one `error:` line and exit code 1 (0 for a signal after start-up).
With --openai-port, the SMG router (openai_router.py) starts once the model is loaded, and
`ready:` waits for it too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError

from shardlm_server.gateway.api.auth import load_tokens
from shardlm_server.gateway.api.server import (
    GatewayServer,
    server_credentials,
    smg_engine_problem,
    start_gateway,
)
from shardlm_server.gateway.config import ServeConfig
from shardlm_server.gateway.serve.default_model import DefaultModelMissing, default_model_path
from shardlm_server.gateway.serve.openai_router import (
    OpenAIRouter,
    RouterSettings,
    free_port,
    reachable_host,
    smg_command,
    url_host,
)
from shardlm_server.gateway.serve.supervisor import Supervisor
from shardlm_server.gateway.workers.processes import WorkerGroup, WorkerTLS, local_device

log = logging.getLogger("shardlm.serve")
T = TypeVar("T")


class StartupInterrupted(Exception):
    """A stop signal arrived before the gateway was serving."""


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def unless_stopped(stop: asyncio.Event, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or StartupInterrupted (with `awaitable` cancelled) once `stop` is
    set. Work running in a thread goes on; the caller stops what it started."""
    task = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done():
        task.cancel()
        raise StartupInterrupted()
    return task.result()


def check_port_free(host: str, port: int | None, what: str = "the gateway") -> None:
    """OSError naming the port when another process already listens on it (port 0 and None
    pick nothing to check)."""
    if not port:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(f"{what} cannot listen on {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise OSError(f"{what} cannot listen on {host}:{port}: {exc.strerror}") from None


def _worker_tls(cfg: ServeConfig) -> WorkerTLS | None:
    if not cfg.worker_tls_ca:  # validated: the three files come together
        return None
    return WorkerTLS(cfg.worker_tls_ca, cfg.worker_tls_cert, cfg.worker_tls_key)


def _check_before_start(cfg: ServeConfig) -> None:
    """What can be checked before any process is started."""
    if cfg.model and not Path(cfg.model).exists():
        raise ValueError(f"model path {cfg.model} does not exist")
    check_port_free(cfg.host, cfg.port)
    check_port_free(cfg.host, cfg.metrics_port, "metrics")
    check_port_free(cfg.host, cfg.smg_port, "the SMG engine API")
    check_port_free(cfg.openai_host, cfg.openai_port, "the OpenAI API")
    for name, port in (("--smg-port", cfg.smg_port), ("--openai-port", cfg.openai_port)):
        if port is not None and (problem := smg_engine_problem()):
            raise ValueError(f"cannot serve {name}: {problem}")
    if cfg.openai_port is not None:
        smg_command()  # RouterError (a ValueError) when SMG is not installed


def _start_workers(cfg: ServeConfig, tls: WorkerTLS | None, group: WorkerGroup | None = None
                   ) -> WorkerGroup:
    """Connect to the --workers addresses, or start local workers (into `group` when given, so
    that another thread can close it while they start)."""
    if cfg.workers:
        return WorkerGroup.connect(cfg.worker_addresses(),
                                   "cuda" if cfg.device == "cuda" else "cpu", tls)
    group = group if group is not None else WorkerGroup(tls=tls)
    device = cfg.device or local_device()
    devices = cfg.device_ids()
    count = len(devices) if devices else cfg.tp or 1
    try:
        group.start_local(count, device=device, devices=devices,
                          start_timeout_s=cfg.worker_start_timeout)
    except BaseException:
        group.close()
        raise
    return group


async def _start_gateway(cfg: ServeConfig, group: WorkerGroup) -> GatewayServer:
    credentials = None
    if cfg.tls_cert:  # validated: certificate and key come together
        credentials = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    tokens = load_tokens(cfg.auth_tokens) if cfg.auth_tokens else None
    model_root = cfg.model_root
    if model_root is None and tokens and cfg.model:
        model_root = str(Path(cfg.model).resolve().parent)  # auth on: never load anywhere
    return await start_gateway(group, host=cfg.host, port=cfg.port, limits=cfg.limits,
                               metrics_port=cfg.metrics_port, credentials=credentials,
                               auth_tokens=tokens, model_root=model_root,
                               load_options=cfg.load_options, **_engine_listener(cfg))


def _engine_listener(cfg: ServeConfig) -> dict:
    """Where the SMG engine API listens: --smg-port on --host when given. --openai-port without
    it takes a port on loopback, the OS's choice at bind time (port 0: no probe-then-bind race,
    and no derived number such as --port + 1 that may be taken); loopback, because that port
    serves without TLS and tokens and only our own SMG child needs it."""
    if cfg.openai_port is not None and cfg.smg_port is None:
        return {"smg_port": 0, "smg_host": "127.0.0.1"}
    return {"smg_port": cfg.smg_port}


def _router_settings(cfg: ServeConfig, server: GatewayServer) -> RouterSettings:
    assert server.smg is not None and cfg.openai_port is not None
    engine_host = "127.0.0.1" if cfg.smg_port is None else reachable_host(cfg.host)
    # --openai-port 0: a free port now, kept across restarts (SMG cannot report one it chose).
    port = cfg.openai_port or free_port(cfg.openai_host)
    return RouterSettings(host=cfg.openai_host, port=port,
                          engine_url=f"grpc://{url_host(engine_host)}:{server.smg[1]}",
                          tool_call_parser=cfg.tool_call_parser,
                          start_timeout_s=cfg.openai_start_timeout)


async def _load(cfg: ServeConfig, server: GatewayServer) -> str:
    """Load --model; the `ready:` line's beginning."""

    def progress(p: common_pb2.LoadProgress) -> None:
        print(f"loading: {p.fraction:4.0%} {p.message}", flush=True)

    try:
        model = await server.runtime.load(cfg.model, cfg.dtype_enum(), 0, cfg.kv_cache(),
                                          progress)
    except ShardLMError as exc:
        raise ValueError(f"could not load {cfg.model}: {exc.message}") from None
    return f"ready: serving {model.info.architecture} from {cfg.model} on {cfg.host}:{server.port}"


async def serve(cfg: ServeConfig) -> int:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    if not cfg.model and not cfg.no_model:
        try:
            cfg = dataclasses.replace(cfg, model=str(default_model_path()))
        except DefaultModelMissing as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"no --model given: serving the default model {Path(cfg.model).name}", flush=True)
    try:
        tls = _worker_tls(cfg)
        _check_before_start(cfg)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    group = WorkerGroup(tls=tls)
    server: GatewayServer | None = None
    supervisor: Supervisor | None = None
    router: OpenAIRouter | None = None
    try:
        try:
            group = await unless_stopped(stop, asyncio.to_thread(_start_workers, cfg, tls, group))
        except (ShardLMError, OSError) as exc:
            raise ValueError(f"could not start workers: {exc}") from None
        server = await unless_stopped(stop, _start_gateway(cfg, group))
        if cfg.workers:
            await unless_stopped(stop, server.runtime.pool.wait_healthy(cfg.worker_start_timeout))
        supervisor = Supervisor(server.runtime, lambda: _start_workers(cfg, tls),
                                start_timeout_s=cfg.worker_start_timeout)
        supervisor.start()
        print(f"ShardLM gateway on {cfg.host}:{server.port} with {group.world_size} worker(s)",
              flush=True)
        if cfg.model:
            ready = await unless_stopped(stop, _load(cfg, server))
        else:
            ready = "no model: waiting for a Load call (health is NOT_SERVING until then)"
        if cfg.openai_port is not None:
            router = OpenAIRouter(_router_settings(cfg, server), server.runtime)
            await unless_stopped(stop, router.start())
            ready += f"; openai: {router.url}"
        print(ready, flush=True)
    except StartupInterrupted:
        print("error: stopped by a signal during start-up", file=sys.stderr)
        await _shut_down(group, server, supervisor, 0, router)
        return 1
    except (ShardLMError, OSError, ValueError, TypeError) as exc:
        message = exc.message if isinstance(exc, ShardLMError) else str(exc)
        print(f"error: {message}", file=sys.stderr)
        await _shut_down(group, server, supervisor, 0, router)
        return 1
    except BaseException:
        await _shut_down(group, server, supervisor, 0, router)
        raise
    await stop.wait()
    print("draining...", flush=True)
    await _shut_down(group, server, supervisor, cfg.drain_grace, router, cfg.drain_announce)
    print("stopped", flush=True)
    return 0


async def _shut_down(group: WorkerGroup, server: GatewayServer | None,
                     supervisor: Supervisor | None, drain_grace_s: float,
                     router: OpenAIRouter | None = None, announce_s: float = 0.0) -> None:
    """Stop what was started; the workers last, whichever group is current. The SMG router
    after the gateway has drained: what is in flight through it is the gateway's to finish."""
    if supervisor is not None:
        await supervisor.stop()
    if server is not None:
        print(f"drained: {await server.drain(drain_grace_s, announce_s)}", flush=True)
        group = server.runtime.group
    if router is not None:
        await router.stop()
    await asyncio.to_thread(group.close)
