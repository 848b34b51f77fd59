"""deploy/k8s: schema-validated offline, then checked for the wiring a rollout depends on.

Schema: kubernetes-validate (PyPI; bundles the Kubernetes OpenAPI schemas, so it works
offline) in strict mode, which rejects unknown fields. `kubectl apply --dry-run=client`
cannot run here (it downloads the schema from a cluster); `kubectl kustomize` can, and checks
the kustomization. The rest are hand checks of cross-references no schema can see.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load(name: str) -> dict:
    docs = list(yaml.safe_load_all((K8S / name).read_text()))
    assert len(docs) == 1, name
    return docs[0]


@pytest.fixture(scope="module")
def deployment() -> dict:
    return load("deployment.yaml")


@pytest.fixture(scope="module")
def container(deployment) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_passes_strict_schema_validation(path) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="!!! SKIPPED LOUDLY: pip install kubernetes-validate (dev extra) for the "
               "offline Kubernetes schema check")
    for doc in yaml.safe_load_all(path.read_text()):
        kv.validate(doc, "1.30.0", strict=True)  # oldest version we support
        kv.validate(doc, kv.latest_version(), strict=True)


def test_strict_validation_rejects_an_unknown_field(deployment) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="!!! SKIPPED LOUDLY: see above")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.latest_version(), strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]
    if shutil.which("kubectl") is None:
        return  # the listing check above still ran; kubectl is optional here
    proc = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout))
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                     "PodDisruptionBudget", "Service"]


def test_probes_hit_ready_and_health_on_the_served_port(container, cpu_stages, smoke) -> None:
    image_env = smoke.stage_env(cpu_stages[-1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": int(image_env["ATTNSERVE_PORT"])}
    assert env_of(container)["ATTNSERVE_PORT"] == image_env["ATTNSERVE_PORT"]
    assert env_of(container)["ATTNSERVE_MODEL"] == image_env["ATTNSERVE_MODEL"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


def test_resources_have_requests_within_limits(container) -> None:
    def cpu(v: str) -> float:
        return float(v[:-1]) / 1000 if v.endswith("m") else float(v)

    def mem(v: str) -> int:
        units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
        return int(float(v[:-2]) * units[v[-2:]])

    res = container["resources"]
    assert cpu(res["requests"]["cpu"]) <= cpu(res["limits"]["cpu"])
    assert mem(res["requests"]["memory"]) <= mem(res["limits"]["memory"])
    # ORT's thread pool must match the CPU the pod may use
    assert int(env_of(container)["ATTNSERVE_INTRA_OP_THREADS"]) == cpu(res["limits"]["cpu"])


def test_prestop_and_drain_fit_in_the_grace_period(deployment, container) -> None:
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(env_of(container)["ATTNSERVE_DRAIN_TIMEOUT"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert float(pre_stop[1]) + drain < grace


def test_pods_run_as_the_image_user(deployment, container, cpu_stages) -> None:
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    image_user = cpu_stages[-1].last("USER").args.split(":")[0]
    assert str(pod_security["runAsUser"]) == image_user
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_prometheus_annotations_point_at_metrics(deployment, container) -> None:
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == container["ports"][0]["containerPort"]


def test_service_hpa_and_pdb_select_the_deployment(deployment) -> None:
    match = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert match.items() <= pod_labels.items()
    service = load("service.yaml")
    assert service["spec"]["selector"] == match
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    pdb = load("pdb.yaml")
    assert pdb["spec"]["selector"]["matchLabels"] == match
    hpa = load("hpa.yaml")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # a CPU-utilisation target is a percentage of the container's CPU request
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "cpu" in deployment["spec"]["template"]["spec"]["containers"][0]["resources"][
        "requests"]


def test_pods_mount_the_model_read_only_from_the_claim(deployment, container, cpu_stages,
                                                       smoke) -> None:
    # The image carries no model (deploy/Dockerfile): the claim holds the exported artifact.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    model_dir = smoke.stage_env(cpu_stages[-1])["ATTNSERVE_MODEL"]
    assert mounts["model"] == {"name": "model", "mountPath": model_dir, "readOnly": True}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    claim = volumes["model"]["persistentVolumeClaim"]
    assert claim == {"claimName": load("pvc.yaml")["metadata"]["name"], "readOnly": True}
    assert "ReadOnlyMany" in load("pvc.yaml")["spec"]["accessModes"]

