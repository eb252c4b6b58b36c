"""TLS, mutual TLS, bearer auth with an admin scope, and Load confined to the model root."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardlm.common.v1 import common_pb2
from shardlm.errors import ShardLMError
from shardlm.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from shardlm_server.gateway.api.auth import load_tokens
from shardlm_server.gateway.api.runtime import Limits
from shardlm_server.gateway.api.server import server_credentials
from tests.gateway.conftest import LiveGateway

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
                "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
                "-extfile", str(d / "san.cnf"), "-out", str(d / f"{name}.pem"))
    return d


@pytest.fixture(scope="module")
def secured(pki, llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(llama_dir, root / "llama")
    escape = root / "escape"
    escape.mkdir()
    for f in llama_dir.iterdir():
        (escape / f.name).symlink_to(f)  # every file links outside the root
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text("admintoken ops admin\nusertoken alice\nbobtoken bob\n")
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes())
    gateway = LiveGateway(
        1, Limits(), channel_credentials=creds,
        credentials=server_credentials(str(pki / "server.pem"), str(pki / "server.key"),
                                       str(pki / "ca.pem")),
        auth_tokens=load_tokens(tokens), model_root=str(root))
    yield gateway, root
    gateway.close()


def md(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def rich(err: pytest.ExceptionInfo) -> ShardLMError:
    return ShardLMError.from_rpc_error(err.value)


def test_mtls_refuses_a_client_without_certificate(secured, pki):
    gateway, _root = secured
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    with grpc.secure_channel(gateway.address, creds) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), metadata=md("admintoken"),
                              timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(gateway.address) as channel:  # plaintext to a TLS port
        with pytest.raises(grpc.RpcError):
            gateway_pb2_grpc.GatewayServiceStub(channel).GetModelInfo(
                gateway_pb2.GetModelInfoRequest(), timeout=5)


def test_auth_tokens_and_admin_scope(secured):
    gateway, root = secured
    stub = gateway.stub
    health = health_pb2_grpc.HealthStub(gateway.channel)
    health.Check(health_pb2.HealthCheckRequest())  # exempt from auth
    with pytest.raises(grpc.RpcError) as err:
        stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
    assert rich(err).code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), metadata=md("wrong"))
    assert (rich(err).code, rich(err).reason) == (grpc.StatusCode.UNAUTHENTICATED,
                                                  "UNAUTHENTICATED")
    load = gateway_pb2.LoadRequest(model_path=str(root / "llama"),
                                   dtype=common_pb2.DTYPE_FLOAT32)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Load(load, metadata=md("usertoken")))
    assert rich(err).code == grpc.StatusCode.PERMISSION_DENIED
    assert list(stub.Load(load, metadata=md("admintoken")))[-1].HasField("model")
    with pytest.raises(grpc.RpcError) as err:
        stub.ResetCache(gateway_pb2.ResetCacheRequest(all=True), metadata=md("usertoken"))
    assert rich(err).code == grpc.StatusCode.PERMISSION_DENIED
    # Sessions belong to whoever created them.
    first = stub.Prefill(gateway_pb2.PrefillRequest(
        token_ids=gateway_pb2.TokenIds(token_ids=[1, 2, 3])), metadata=md("usertoken"))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(gateway_pb2.DecodeRequest(session_id=first.session_id),
                         metadata=md("bobtoken")))
    assert rich(err).code == grpc.StatusCode.NOT_FOUND
    chunks = list(stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id, stop=common_pb2.StopConditions(max_new_tokens=3)),
        metadata=md("usertoken")))
    assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.mark.parametrize("path", ["../", "/etc", "llama/../../", "escape", "missing"])
def test_load_cannot_escape_the_model_root(secured, path):
    gateway, root = secured
    target = path if path.startswith("/") else str(root / path)
    with pytest.raises(grpc.RpcError) as err:
        list(gateway.stub.Load(gateway_pb2.LoadRequest(model_path=target),
                               metadata=md("admintoken")))
    error = rich(err)
    if path == "missing":
        assert error.code == grpc.StatusCode.NOT_FOUND
    else:
        assert (error.code, error.reason) == (grpc.StatusCode.PERMISSION_DENIED,
                                              "PATH_NOT_ALLOWED")


def test_gateway_and_workers_talk_mutual_tls(pki, llama_dir):
    from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

    from shardlm_server.gateway.workers.processes import WorkerTLS

    tls = WorkerTLS(str(pki / "ca.pem"), str(pki / "server.pem"), str(pki / "server.key"))
    gateway = LiveGateway(2, Limits(), worker_tls=tls)
    try:
        list(gateway.stub.Load(gateway_pb2.LoadRequest(model_path=str(llama_dir),
                                                        dtype=common_pb2.DTYPE_FLOAT32)))
        chunks = list(gateway.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=[1, 2, 3]),
            stop=common_pb2.StopConditions(max_new_tokens=4, ignore_eos=True))))
        assert sum(len(c.token_ids) for c in chunks) == 4
        worker = gateway.group.handles[0].address
        for creds in (None, grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())):
            channel = (grpc.secure_channel(worker, creds) if creds
                       else grpc.insecure_channel(worker))
            with channel, pytest.raises(grpc.RpcError):  # no client certificate: refused
                worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(
                    worker_pb2.GetInfoRequest(), timeout=5)
    finally:
        gateway.close()
