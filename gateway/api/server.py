"""Assemble and run the gateway: the API, health, reflection and metrics, and a graceful drain.

Health is NOT_SERVING until a model is loaded and again from the moment a shutdown begins. A
shutdown first announces itself (health NOT_SERVING, the SMG engine service's HealthCheck
unhealthy, a KV-event clear that withdraws this replica's prefixes from the routers) while new
calls are still taken, until no call has come for QUIET_S or the announce period ends, so that
routers and load balancers stop sending work before any is refused; it then refuses new calls
(UNAVAILABLE, reason DRAINING, with a retry delay: a router retries them elsewhere), lets
in-flight streams finish within a grace period, and stops the server.

The SMG engine API (gateway/api/smg_service.py) is imported only when the gateway starts, and served
when its package, smg-grpc-proto, imports: a machine without it (or with a grpcio or protobuf
older than its generated code asks for) still serves ShardLM's own API, and says why the
engine API is missing; `--smg-port` then refuses to start (`smg_engine_problem`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from shardlm.constants import DEFAULT_HOST, MAX_REQUEST_BYTES
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from shardlm_server.gateway.api.auth import AuthInterceptor, Identity
from shardlm_server.gateway.api.interceptors import ErrorInterceptor
from shardlm_server.gateway.api.runtime import SERVICE_NAME, Runtime
from shardlm_server.gateway.api.servicer import GatewayServicer
from shardlm_server.gateway.config import Limits, LoadOptions
from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.workers.processes import WorkerGroup

log = logging.getLogger("shardlm.gateway")

QUIET_S = 1.0  # a shutdown's announcement ends once no call has come for this long


@dataclass
class GatewayServer:
    server: grpc.aio.Server
    runtime: Runtime
    metrics: Metrics
    port: int
    smg: tuple[grpc.aio.Server, int] | None = None  # the --smg-port listener and its port

    async def drain(self, grace_s: float = 30.0, announce_s: float = 0.0) -> str:
        """Announce the shutdown (up to announce_s), stop taking calls, let the running ones
        finish (up to grace_s), then stop; returns what happened, for the operator's log."""
        rt = self.runtime
        rt.stopping = True
        await rt.set_serving(False)
        rt.kv_events.withdraw()
        taken = await self._announce(announce_s)
        rt.draining = True
        deadline = asyncio.get_running_loop().time() + grace_s
        while rt.model is not None and (rt.model.scheduler.running or rt.model.scheduler.waiting):
            if asyncio.get_running_loop().time() > deadline:
                log.warning("drain grace period over; cancelling what still runs")
                break
            await asyncio.sleep(0.05)
        await self.server.stop(grace=1.0)
        if self.smg is not None:
            await self.smg[0].stop(grace=1.0)
        await rt.close()
        return (f"{taken} new calls taken while the shutdown was announced, "
                f"{rt.refused_while_draining} refused after")

    async def _announce(self, announce_s: float) -> int:
        """Wait while routers may still send (see the module's docstring); the calls started
        meanwhile."""
        scheduler = self.runtime.model.scheduler if self.runtime.model is not None else None
        if scheduler is None or announce_s <= 0:
            return 0
        start, first = time.monotonic(), scheduler.submitted
        while (now := time.monotonic()) - start < announce_s:
            if now - max(scheduler.last_submitted, start) >= QUIET_S:
                break
            await asyncio.sleep(0.05)
        return scheduler.submitted - first


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS with the given certificate; with `client_ca`, mutual TLS (clients must present a
    certificate signed by that CA)."""
    pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=ca is not None)


SMG_ENGINE_MODULE = "shardlm_server.gateway.api.smg_service"


def _smg_engine():
    """gateway/api/smg_service.py and "", or None and why it does not import here."""
    try:
        return importlib.import_module(SMG_ENGINE_MODULE), ""
    # ImportError when smg-grpc-proto is missing; the generated stubs' own version checks raise
    # RuntimeError (grpcio) or protobuf's VersionError (an Exception) when a runtime is too old.
    except Exception as exc:  # noqa: BLE001 - any failure means "not served", and says why
        return None, (f"the SMG engine API needs the smg-grpc-proto package, which does not "
                      f"import here ({type(exc).__name__}: {exc})")


def smg_engine_problem() -> str:
    """Why the SMG engine API cannot be served here ("" when it can)."""
    return _smg_engine()[1]


async def start_gateway(group: WorkerGroup, *, host: str = DEFAULT_HOST, port: int = 0,
                        limits: Limits | None = None, metrics_port: int | None = None,
                        credentials: grpc.ServerCredentials | None = None,
                        auth_tokens: dict[str, Identity] | None = None,
                        model_root: str | None = None,
                        load_options: LoadOptions | None = None,
                        smg_port: int | None = None,
                        smg_host: str | None = None) -> GatewayServer:
    """`smg_host`: the interface of the `smg_port` listener (default: `host`)."""
    metrics = Metrics()
    health = health_aio.HealthServicer()
    runtime = Runtime(group, metrics, limits or Limits(), health, model_root, load_options)
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor(metrics)]
    if auth_tokens:
        interceptors.append(AuthInterceptor(auth_tokens))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                 ("grpc.so_reuseport", 0)])
    api = GatewayServicer(runtime)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(api, server)
    smg_service, smg_problem = _smg_engine()
    if smg_service is None:
        log.warning("not serving the SMG engine API: %s", smg_problem)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name,
             "grpc.health.v1.Health", reflection.SERVICE_NAME)
    if smg_service is not None:  # for the SMG router (gateway/api/smg_service.py)
        names += (smg_service.add_smg_engine_service(server, api),)
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials
                 else server.add_insecure_port(address))
    except RuntimeError:  # grpc's way of saying the port is taken or the host is not local
        bound = 0
    if bound == 0:
        await runtime.pool.close()
        raise OSError(f"cannot listen on {address}: the port is in use or the host is not local")
    await runtime.set_serving(False)
    await server.start()
    if metrics_port is not None:
        try:
            metrics.serve_http(metrics_port, host)
        except OSError as exc:
            await server.stop(grace=None)
            await runtime.pool.close()
            raise OSError(f"cannot serve metrics on {host}:{metrics_port}: {exc.strerror}") from None
    smg = None
    if smg_port is not None:
        if smg_service is None:
            await server.stop(grace=None)
            await runtime.pool.close()
            raise OSError(f"cannot serve --smg-port: {smg_problem}")
        smg = await smg_service.start_smg_server(api, [ErrorInterceptor(metrics)],
                                                 smg_host or host, smg_port)
    assert SERVICE_NAME == names[0]
    return GatewayServer(server, runtime, metrics, bound, smg)
