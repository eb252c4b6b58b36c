"""The Kubernetes manifests in deploy/: every object is valid for the Kubernetes schemas
(kubernetes-validate), the LeaderWorkerSet for its CRD's schema (deploy/schemas/), and the pieces
fit together: ranks and addresses from the LWS environment, GPUs, shared memory, probes, the
read-only model volume, the TLS and auth secrets, the disruption budget and the router."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
LWS_SCHEMA = DEPLOY / "schemas" / "leaderworkerset-v1.schema.json"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes these manifests are checked against
WORKER_PORT, SMG_PORT, GATEWAY_PORT = 50061, 50052, 50051


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = _documents()


def _one(kind: str) -> dict:
    found = [d for _, d in DOCS if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


@pytest.fixture(scope="module")
def lws() -> dict:
    return _one("LeaderWorkerSet")


def _templates(lws: dict) -> dict[str, dict]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def _container(pod: dict, name: str) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


@pytest.mark.parametrize("name, doc", [(n, d) for n, d in DOCS if d["kind"] != "LeaderWorkerSet"],
                         ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_core_objects_match_the_kubernetes_schemas(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_leaderworkerset_matches_its_crd_schema(lws):
    jsonschema.validate(lws, json.loads(LWS_SCHEMA.read_text()))


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_pod_templates_match_the_kubernetes_schemas(lws, role):
    template = _templates(lws)[role]
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                    "metadata": {"name": f"shardlm-{role}"}, "template": template}
    kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_the_lws_schema_refuses_a_mistake(lws):
    broken = json.loads(json.dumps(lws))
    broken["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroup"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(LWS_SCHEMA.read_text()))
    broken = json.loads(json.dumps(lws))
    broken["spec"]["leaderWorkerTemplat"] = broken["spec"].pop("leaderWorkerTemplate")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(LWS_SCHEMA.read_text()))


def test_a_group_restarts_as_a_whole(lws):
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_each_rank_gets_a_gpu_shared_memory_and_the_read_only_models(lws):
    ranks = [_container(_templates(lws)["leader"], "worker"),
             _container(_templates(lws)["worker"], "worker")]
    for worker in ranks:
        assert worker["command"][:2] == ["shardlm", "worker"]
        assert worker["command"][worker["command"].index("--port") + 1] == str(WORKER_PORT)
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
        mounts = {m["name"]: m for m in worker["volumeMounts"]}
        assert mounts["models"]["readOnly"] is True and mounts["dshm"]["mountPath"] == "/dev/shm"
        env = {e["name"] for e in worker["env"]}
        assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= env
    for template in _templates(lws).values():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "shardlm-models",
                                                              "readOnly": True}
    claim = _one("PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "shardlm-models"
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_every_container_has_probes(lws):
    for template in _templates(lws).values():
        for container in template["spec"]["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container
    gateway = _container(_templates(lws)["leader"], "gateway")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = gateway[probe]["exec"]["command"]
        assert command[:2] == ["python", "/opt/shardlm/healthcheck.py"]
        assert command[2] == f"127.0.0.1:{GATEWAY_PORT}" and "--tls-ca" in command
    readiness = gateway["readinessProbe"]["exec"]["command"]
    assert readiness[readiness.index("--service") + 1] == "shardlm.gateway.v1.GatewayService"


def _leader_script(lws: dict) -> str:
    gateway = _container(_templates(lws)["leader"], "gateway")
    assert gateway["command"] == ["/bin/sh", "-c"]
    return gateway["args"][0]


def _run_leader_script(lws: dict, tmp_path: Path, group_size: int) -> list[str]:
    """The gateway's command line, as the leader pod's script builds it from the LWS
    environment (a stand-in `shardlm` prints its arguments)."""
    (tmp_path / "shardlm").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (tmp_path / "shardlm").chmod(0o755)
    gateway = _container(_templates(lws)["leader"], "gateway")
    env = {e["name"]: e["value"] for e in gateway["env"]}
    env.update(PATH=f"{tmp_path}:{os.environ['PATH']}", LWS_GROUP_SIZE=str(group_size),
               LWS_LEADER_ADDRESS="shardlm-3.shardlm.prod", LWS_WORKER_INDEX="0")
    done = subprocess.run(["/bin/sh", "-c", _leader_script(lws)], env=env, capture_output=True,
                          text=True, timeout=30, check=True)
    return done.stdout.splitlines()


@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_ranks_and_addresses_come_from_the_lws_environment(lws, tmp_path, group_size):
    argv = _run_leader_script(lws, tmp_path, group_size)
    assert argv[0] == "serve"
    workers = argv[argv.index("--workers") + 1].split(",")
    expected = ["shardlm-3.shardlm.prod"] + [f"shardlm-3-{r}.shardlm.prod"
                                            for r in range(1, group_size)]
    assert workers == [f"{host}:{WORKER_PORT}" for host in expected]
    assert not any(w.startswith(("127.", "localhost", "[::1]")) for w in workers)
    assert argv[argv.index("--smg-port") + 1] == str(SMG_PORT)
    assert argv[argv.index("--model-root") + 1] == "/models"


def test_tls_and_auth_come_from_secrets(lws, tmp_path):
    argv = _run_leader_script(lws, tmp_path, 2)
    gateway = _container(_templates(lws)["leader"], "gateway")
    mounts = {m["mountPath"]: m["name"] for m in gateway["volumeMounts"]}
    volumes = {v["name"]: v for v in _templates(lws)["leader"]["spec"]["volumes"]}
    for flag, secret in (("--tls-cert", "shardlm-tls"), ("--tls-key", "shardlm-tls"),
                         ("--auth-tokens", "shardlm-auth")):
        path = Path(argv[argv.index(flag) + 1])
        assert volumes[mounts[str(path.parent)]]["secret"]["secretName"] == secret
    router = _container(_one("Deployment")["spec"]["template"], "smg")
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in router["env"]}
    assert env == {"SMG_API_KEY": "shardlm-auth"}
    assert "--api-key=$(SMG_API_KEY)" in router["args"]


def test_disruption_budget_and_service_select_shardlm_pods(lws):
    leader_labels = _templates(lws)["leader"]["metadata"]["labels"]
    worker_labels = _templates(lws)["worker"]["metadata"]["labels"]
    budget = _one("PodDisruptionBudget")["spec"]
    assert budget["maxUnavailable"] == 1
    for labels in (leader_labels, worker_labels):
        assert budget["selector"]["matchLabels"].items() <= labels.items()
    service = next(d for _, d in DOCS if d["kind"] == "Service"
                   and d["metadata"]["name"] == "shardlm-gateway")
    selector = dict(service["spec"]["selector"])
    # The LWS controller labels every pod with its worker index; the leader's is 0.
    assert selector.pop("leaderworkerset.sigs.k8s.io/worker-index") == "0"
    assert selector.items() <= leader_labels.items()


def test_the_router_reaches_every_group_on_the_smg_port(lws):
    router = _container(_one("Deployment")["spec"]["template"], "smg")
    assert router["command"] == ["smg", "launch"]
    args = router["args"]
    start = args.index("--worker-urls") + 1
    urls = []
    while start < len(args) and not args[start].startswith("--"):
        urls.append(args[start])
        start += 1
    name = lws["metadata"]["name"]
    assert urls == [f"grpc://{name}-{g}.{name}:{SMG_PORT}" for g in range(lws["spec"]["replicas"])]
    policy = _one("NetworkPolicy")["spec"]["ingress"]
    smg_rule = next(r for r in policy if {"port": SMG_PORT} in r.get("ports", []))
    assert smg_rule["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "shardlm-smg"}}}]
    leader_ports = {p["containerPort"] for p in
                    _container(_templates(lws)["leader"], "gateway")["ports"]}
    assert {GATEWAY_PORT, SMG_PORT} <= leader_ports


def test_the_leader_script_is_posix_sh(lws):
    done = subprocess.run(["/bin/sh", "-n", "-c", _leader_script(lws)], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "exec shardlm serve" in " ".join(shlex.split(_leader_script(lws), comments=True))
