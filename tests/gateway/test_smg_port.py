"""`serve --smg-port`: a gateway whose main port requires TLS and bearer tokens serves SMG's
engine API on a plaintext port of its own (SMG's gRPC client speaks neither), and the health
check the Kubernetes probes run reaches the TLS port."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from shardlm.gateway.v1 import gateway_pb2

pytest.importorskip("smg_grpc_proto")
from smg_grpc_proto.generated import vllm_engine_pb2 as engine_pb2  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as engine_pb2_grpc  # noqa: E402

from shardlm_server.gateway.api.auth import Identity  # noqa: E402
from shardlm_server.gateway.api.runtime import Limits  # noqa: E402
from shardlm_server.gateway.api.server import server_credentials  # noqa: E402
from tests.gateway.conftest import LiveGateway  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
HEALTHCHECK = Path(__file__).resolve().parents[2] / "scripts" / "healthcheck.py"
TOKEN = "router-test-token"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=test-ca", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    (d / "san.cnf").write_text("subjectAltName=DNS:shardlm-gateway\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=shardlm-gateway",
             "-keyout", str(d / "tls.key"), "-out", str(d / "tls.csr"))
    _openssl("x509", "-req", "-in", str(d / "tls.csr"), "-CA", str(d / "ca.crt"), "-CAkey",
             str(d / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile", str(d / "san.cnf"),
             "-out", str(d / "tls.crt"))
    return d


@pytest.fixture(scope="module")
def secured(pki, llama_dir):
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.crt").read_bytes())
    gateway = LiveGateway(
        1, Limits(), channel_credentials=grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(TOKEN)),
        credentials=server_credentials(str(pki / "tls.crt"), str(pki / "tls.key"), None),
        auth_tokens={TOKEN: Identity("router", admin=True)}, smg_port=0)
    gateway.channel.close()  # the certificate names shardlm-gateway, not 127.0.0.1
    gateway.channel = grpc.secure_channel(
        gateway.address, grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(TOKEN)),
        options=[("grpc.ssl_target_name_override", "shardlm-gateway")])
    gateway.stub = type(gateway.stub)(gateway.channel)
    for _ in gateway.stub.Load(gateway_pb2.LoadRequest(model_path=str(llama_dir))):
        pass
    yield gateway
    gateway.close()


def test_engine_api_on_the_smg_port_needs_no_token(secured):
    port = secured.server.smg[1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        engine = engine_pb2_grpc.VllmEngineStub(channel)
        assert engine.HealthCheck(engine_pb2.HealthCheckRequest()).healthy
        reply = list(engine.Generate(engine_pb2.GenerateRequest(
            request_id="a", tokenized=engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
            sampling_params=engine_pb2.SamplingParams(temperature=0, max_tokens=3))))
        assert reply[-1].complete.completion_tokens == 3


def test_main_port_still_requires_the_token(secured, pki):
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.crt").read_bytes())
    options = [("grpc.ssl_target_name_override", "shardlm-gateway")]
    with grpc.secure_channel(secured.address, creds, options=options) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(engine_pb2.HealthCheckRequest())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True,
                          text=True, timeout=60)


def test_healthcheck_probes_a_tls_gateway(secured, pki):
    tls = ["--tls-ca", str(pki / "ca.crt"), "--tls-server-name", "shardlm-gateway"]
    assert _healthcheck(secured.address, *tls).returncode == 0
    ready = _healthcheck(secured.address, "--service", "shardlm.gateway.v1.GatewayService", *tls)
    assert ready.returncode == 0, ready.stderr
    plain = _healthcheck(secured.address, "--timeout", "2")
    assert plain.returncode == 1 and "unhealthy" in plain.stderr
