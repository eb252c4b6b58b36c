"""The SMG engine API is optional at run time: a gateway whose machine lacks smg-grpc-proto (or
has a grpcio or protobuf too old for its generated code) still serves ShardLM's own API and says
why the engine API is missing, and `serve --smg-port` refuses to start there with that reason."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from shardlm_server.gateway.api import server as gateway_server
from shardlm_server.gateway.api.runtime import SERVICE_NAME, Limits
from shardlm_server.gateway.api.server import start_gateway
from shardlm_server.gateway.config import ServeConfig
from shardlm_server.gateway.serve import lifecycle
from shardlm_server.gateway.workers.processes import WorkerGroup
from tests.gateway.conftest import TEST_DEVICE, LiveGateway

MISSING = "shardlm_server.gateway.no_such_smg_module"


@pytest.fixture
def without_smg(monkeypatch):
    monkeypatch.setattr(gateway_server, "SMG_ENGINE_MODULE", MISSING)


def test_the_problem_names_the_package_and_the_import_error(without_smg):
    problem = gateway_server.smg_engine_problem()
    assert "needs the smg-grpc-proto package" in problem
    assert "ModuleNotFoundError" in problem and MISSING in problem


def test_no_problem_where_the_package_imports():
    pytest.importorskip("smg_grpc_proto")
    assert gateway_server.smg_engine_problem() == ""


def test_smg_port_is_refused_before_anything_starts(without_smg):
    cfg = dataclasses.replace(ServeConfig(), port=0, metrics_port=None, smg_port=0)
    with pytest.raises(ValueError, match="cannot serve --smg-port: the SMG engine API needs "
                                         "the smg-grpc-proto package"):
        lifecycle._check_before_start(cfg)
    lifecycle._check_before_start(dataclasses.replace(cfg, smg_port=None))  # the rest is fine


def test_the_gateway_serves_its_own_api_without_the_engine_api(without_smg, caplog):
    gateway = LiveGateway(1, Limits())
    try:
        channel = grpc.insecure_channel(gateway.address)
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        channel.close()
        assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
        assert not any("VllmEngine" in name for name in services)
        assert "not serving the SMG engine API" in caplog.text
    finally:
        gateway.close()


def test_start_gateway_with_an_smg_port_fails_cleanly_without_the_package(without_smg):
    group = WorkerGroup.spawn(1, device=TEST_DEVICE)
    try:
        with pytest.raises(OSError, match="cannot serve --smg-port: the SMG engine API needs"):
            asyncio.run(start_gateway(group, limits=Limits(), smg_port=0))
    finally:
        group.close()
