"""deploy/k8s-gateway: the base behind Kubernetes' Gateway API Inference Extension, rendered
by `kubectl kustomize` and each object checked against its schema; then the wiring the
endpoint picker depends on.

Schemas: the core objects (the picker's Deployment, Service, ServiceAccount, Role,
RoleBinding, ConfigMap) by kubernetes-validate in strict mode, as the base's; the
InferencePool, a custom resource whose CRD cannot be fetched here, by the JSON schema below,
written from the extension's v1 API types (api/v1/inferencepool_types.go: required fields,
one target port, the failure modes, no unknown fields). The metric flags are checked against
what attnserve's /metrics really exposes (service/http/metrics.py rendered with adapters and
a prefix cache), parsed as the picker parses it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "k8s-gateway"
FILES = sorted(p for p in OVERLAY.glob("*.yaml") if p.name != "kustomization.yaml")

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_V1 = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": _NAME, "labels": {"type": "object"}}},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False, "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1,
                        "additionalProperties": {"type": "string"}}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _PORT},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string"}, "kind": {"type": "string"},
                        "name": _NAME, "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}}}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, Any]]:
    """The overlay as kubectl renders it: "Kind/name" → object."""
    if shutil.which("kubectl") is None:
        pytest.skip("!!! SKIPPED LOUDLY: kubectl is not on PATH, so the overlay cannot be "
                    "rendered (kubectl kustomize) here")
    proc = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(proc.stdout)}


def test_the_overlay_renders_the_base_and_the_picker(rendered: dict[str, dict[str, Any]]
                                                     ) -> None:
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == ["../k8s", *(p.name for p in FILES)]
    assert sorted(rendered) == [
        "ConfigMap/attnserve-epp", "Deployment/attnserve", "Deployment/attnserve-epp",
        "HorizontalPodAutoscaler/attnserve", "InferencePool/attnserve",
        "PersistentVolumeClaim/attnserve-model", "PodDisruptionBudget/attnserve",
        "Role/attnserve-epp", "RoleBinding/attnserve-epp", "Service/attnserve",
        "Service/attnserve-epp", "ServiceAccount/attnserve-epp"]


def test_every_object_passes_its_schema(rendered: dict[str, dict[str, Any]]) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="!!! SKIPPED LOUDLY: pip install kubernetes-validate (dev extra) for the "
               "offline Kubernetes schema check")
    import jsonschema

    for doc in rendered.values():
        if doc["kind"] == "InferencePool":
            jsonschema.validate(doc, INFERENCE_POOL_V1)
            continue
        kv.validate(doc, "1.30.0", strict=True)
        kv.validate(doc, kv.latest_version(), strict=True)
    broken = yaml.safe_load(yaml.safe_dump(rendered["InferencePool/attnserve"]))
    broken["spec"]["extensionRef"] = {"name": "attnserve-epp"}  # v1alpha2's field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, INFERENCE_POOL_V1)


def test_the_pool_selects_the_servers_and_points_at_the_picker(
        rendered: dict[str, dict[str, Any]]) -> None:
    pool = rendered["InferencePool/attnserve"]["spec"]
    server = rendered["Deployment/attnserve"]["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= server["metadata"]["labels"].items()
    http = next(p for p in server["spec"]["containers"][0]["ports"] if p["name"] == "http")
    assert pool["targetPorts"] == [{"number": http["containerPort"]}]
    service = rendered["Service/attnserve-epp"]
    ref = pool["endpointPickerRef"]
    assert (ref["kind"], ref["name"]) == ("Service", service["metadata"]["name"])
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    picker = rendered["Deployment/attnserve-epp"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= picker["metadata"]["labels"].items()
    container = picker["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[grpc["targetPort"]] == ref["port"]["number"] == int(flags(container)["grpc-port"])
    assert flags(container)["pool-name"] == rendered["InferencePool/attnserve"]["metadata"]["name"]


def flags(container: dict[str, Any]) -> dict[str, str]:
    """The picker's --name=value arguments."""
    found = {}
    for arg in container["args"]:
        match = re.fullmatch(r"--([a-z-]+)=(.*)", arg)
        assert match is not None, arg
        found[match[1]] = match[2]
    return found


def test_the_picker_can_read_its_pool_pods_and_plugins(rendered: dict[str, dict[str, Any]]
                                                       ) -> None:
    picker = rendered["Deployment/attnserve-epp"]["spec"]["template"]["spec"]
    binding = rendered["RoleBinding/attnserve-epp"]
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": picker["serviceAccountName"]}]
    assert f"ServiceAccount/{picker['serviceAccountName']}" in rendered
    rules = rendered[f"Role/{binding['roleRef']['name']}"]["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    for group, resource in (("inference.networking.k8s.io", "inferencepools"), ("", "pods")):
        assert {(group, resource, v) for v in ("get", "list", "watch")} <= granted
    container = picker["containers"][0]
    mount = container["volumeMounts"][0]
    volume = next(v for v in picker["volumes"] if v["name"] == mount["name"])
    config_map = rendered[f"ConfigMap/{volume['configMap']['name']}"]
    config_file = Path(flags(container)["config-file"])
    assert config_file.parent == Path(mount["mountPath"])
    config = yaml.safe_load(config_map["data"][config_file.name])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    assert {p["pluginRef"] for p in profile["plugins"]} == declared
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer",
            "lora-affinity-scorer"} <= declared


def test_the_metric_flags_name_gauges_attnserve_exposes(rendered: dict[str, dict[str, Any]],
                                                        tmp_path: Path) -> None:
    """Every metric flag names a gauge of a real /metrics exposition (a server with
    adapters and a prefix cache), with the labels the picker reads."""
    from service.engine.adapters import AdapterLimits, AdapterSet, AdapterSlots
    from service.http.metrics import Metrics
    from tests.service.engine.test_adapters import MODULES, write_adapter

    metrics = Metrics()
    adapters = AdapterSet(AdapterSlots(MODULES, AdapterLimits(max_loras=2, max_lora_rank=8)))
    write_adapter(tmp_path / "a", 4, seed=0)
    adapters.add(adapters.read(tmp_path / "a", "a"))
    metrics.watch_adapters(adapters)
    metrics.set_cache_config(block_size=16, blocks=100)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render()[0].decode())}
    picker = rendered["Deployment/attnserve-epp"]["spec"]["template"]["spec"]["containers"][0]
    wanted = {"total-queued-requests-metric": set(), "total-running-requests-metric": set(),
              "kv-cache-usage-percentage-metric": set(),
              "lora-info-metric": {"max_lora", "running_lora_adapters", "waiting_lora_adapters"},
              "cache-info-metric": {"block_size", "num_gpu_blocks"}}
    given = flags(picker)
    for flag, labels in wanted.items():
        family = families.get(given[flag])
        assert family is not None and family.type == "gauge", (flag, given[flag])
        (sample,) = family.samples
        assert set(sample.labels) == labels, flag
