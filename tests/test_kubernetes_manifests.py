"""deploy/kubernetes/ as a cluster would take it: every manifest the kustomization lists, the core
kinds validated strictly against the Kubernetes 1.33 schemas (kubernetes-validate, offline), the
Inference Extension kinds against their v1/v1alpha2 fields, and the wiring between them: the pool
selects the DaemonSet's pods on its container port, the probes ask /ready and /health, the grace
period outlasts the drain, the ConfigMap passes gpushare's own config loader once the init step has
written the Secret's keys' digests into it (and accepts no key before), the shipped placeholder keys
are refused, the Containerfile builds what the DaemonSet runs, the route sets or strips the gateway
headers the daemon trusts, and a NetworkPolicy admits only the gateway and the picker to the pods' port."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import secrets
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gpushare.api.gateway import FAIRNESS_HEADER, OBJECTIVE_HEADER
from gpushare.api.gateway_metrics import GATEWAY_METRICS_PATH
from gpushare.protocol.tenant_policy import PRIORITIES
from gpushare.settings.settings import ConfigError, parse_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.33"
GIE_KINDS = {"InferencePool", "InferenceObjective"}
GATEWAY_API_KINDS = {"HTTPRoute"}


def load_manifests() -> list[dict]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]
    return docs


MANIFESTS = load_manifests()


def one(kind: str, name: str | None = None) -> dict:
    found = [d for d in MANIFESTS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} manifests"
    return found[0]


def daemon_container() -> dict:
    return one("DaemonSet", "gpushare")["spec"]["template"]["spec"]["containers"][0]


def init_step() -> dict:
    (container,) = one("DaemonSet", "gpushare")["spec"]["template"]["spec"]["initContainers"]
    return container


def rendered_config(keys: dict[str, str]) -> str:
    """The config the DaemonSet's init step writes from the ConfigMap and a Secret holding `keys`: its
    own shell script, run here with its paths in a temp folder."""
    step = init_step()
    with tempfile.TemporaryDirectory() as tmp:
        template, keys_dir, config = Path(tmp, "gpushare.yaml.in"), Path(tmp, "keys"), Path(tmp, "gpushare.yaml")
        template.write_text(one("ConfigMap", "gpushare-config")["data"]["gpushare.yaml"])
        keys_dir.mkdir()
        for tenant, key in keys.items():
            (keys_dir / tenant).write_text(key)
        env = {**os.environ, "TEMPLATE_FILE": str(template), "KEYS_DIR": str(keys_dir), "CONFIG_FILE": str(config)}
        done = subprocess.run([*step["command"], *step["args"]], env=env, capture_output=True, text=True, timeout=30)
        if done.returncode:
            raise RuntimeError(done.stderr)
        return config.read_text()


TENANT_KEYS = {"chat": secrets.token_hex(24), "batch": secrets.token_hex(24), "ops": secrets.token_hex(24)}


def gpushare_config(keys: dict[str, str] = TENANT_KEYS):
    return parse_settings(yaml.safe_load(rendered_config(keys)), env={})


def test_the_kustomization_lists_every_manifest_file():
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert {d["metadata"].get("namespace") for d in MANIFESTS if d["kind"] != "Namespace"} == {"gpushare"}


@pytest.mark.parametrize("doc", [d for d in MANIFESTS if d["kind"] not in GIE_KINDS | GATEWAY_API_KINDS],
                         ids=lambda d: f'{d["kind"]}/{d["metadata"]["name"]}')
def test_core_kinds_are_valid_kubernetes_1_33(doc):
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_strict_validation_rejects_a_misspelt_field():
    """The validator runs offline from its bundled schemas and refuses what the API server would."""
    daemonset = copy.deepcopy(one("DaemonSet", "gpushare"))
    daemonset["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, K8S_VERSION, strict=True)


def test_every_kind_is_accounted_for():
    kinds = {d["kind"] for d in MANIFESTS}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "Secret", "DaemonSet", "Service", "InferencePool",
            "InferenceObjective"} <= kinds
    assert kinds - {"Namespace", "ServiceAccount", "ConfigMap", "Secret", "DaemonSet", "Service", "Deployment",
                    "Role", "RoleBinding", "NetworkPolicy"} == GIE_KINDS | GATEWAY_API_KINDS


# The Inference Extension's fields (inference.networking.k8s.io/v1 InferencePool,
# inference.networking.x-k8s.io/v1alpha2 InferenceObjective): no schema ships with kubernetes-validate.
def check_fields(value: dict, allowed: set[str], required: set[str], where: str) -> None:
    assert set(value) <= allowed, f"{where}: unknown fields {set(value) - allowed}"
    assert required <= set(value), f"{where}: missing {required - set(value)}"


def test_the_inference_pool_has_the_v1_fields():
    pool = one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    check_fields(spec, {"selector", "targetPorts", "appProtocol", "endpointPickerRef"},
                 {"selector", "targetPorts", "endpointPickerRef"}, "spec")
    check_fields(spec["selector"], {"matchLabels"}, {"matchLabels"}, "spec.selector")
    assert 1 <= len(spec["targetPorts"]) <= 8
    for port in spec["targetPorts"]:
        check_fields(port, {"number"}, {"number"}, "spec.targetPorts[]")
    ref = spec["endpointPickerRef"]
    check_fields(ref, {"group", "kind", "name", "port", "failureMode"}, {"name", "port"}, "spec.endpointPickerRef")
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_one_objective_per_tenant_priority_names_the_pool():
    objectives = [d for d in MANIFESTS if d["kind"] == "InferenceObjective"]
    priorities = {t.priority for t in gpushare_config().tenants}
    assert {o["metadata"]["name"] for o in objectives} == priorities == {"interactive", "batch"}
    for o in objectives:
        assert o["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
        check_fields(o["spec"], {"priority", "poolRef"}, {"poolRef"}, "InferenceObjective.spec")
        assert o["spec"]["poolRef"] == {"group": "inference.networking.k8s.io", "name": "gpushare"}
    by_name = {o["metadata"]["name"]: o["spec"]["priority"] for o in objectives}
    assert by_name["interactive"] > by_name["batch"]  # the picker serves higher numbers first


def test_the_pool_selects_the_daemonset_pods_on_the_container_port():
    pool = one("InferencePool")["spec"]
    daemonset = one("DaemonSet", "gpushare")["spec"]
    pod_labels = daemonset["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert daemonset["selector"]["matchLabels"].items() <= pod_labels.items()
    container_ports = {p["containerPort"] for p in daemon_container()["ports"]}
    assert [p["number"] for p in pool["targetPorts"]] == [11434] and 11434 in container_ports
    assert gpushare_config().server.host == "0.0.0.0:11434"  # the daemon listens where the pool sends


def test_the_route_and_the_picker_point_at_the_pool():
    pool = one("InferencePool")
    for rule in one("HTTPRoute")["spec"]["rules"]:
        assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                        "name": pool["metadata"]["name"]}]
    ref = pool["spec"]["endpointPickerRef"]
    epp_service = one("Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    epp = one("Deployment", ref["name"])["spec"]["template"]
    assert epp_service["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    args = epp["spec"]["containers"][0]["args"]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--pool-name"] == pool["metadata"]["name"] and flags["--pool-namespace"] == "gpushare"
    # The picker sends no key: it scrapes the open gateway path, which the config opens.
    assert flags["--model-server-metrics-path"] == GATEWAY_METRICS_PATH
    assert gpushare_config().server.open_gateway_metrics
    rules = one("Role", "gpushare-epp")["rules"]
    assert any("pods" in r["resources"] for r in rules) and any("inferencepools" in r["resources"] for r in rules)


def test_probes_ask_ready_and_health_on_the_container_port():
    container = daemon_container()
    http_port = next(p for p in container["ports"] if p["name"] == "http")
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": http_port["name"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": http_port["name"]}
    service = one("Service", "gpushare")["spec"]
    assert service["ports"][0]["targetPort"] == "http"
    assert service["selector"].items() <= one("DaemonSet", "gpushare")["spec"]["template"]["metadata"][
        "labels"].items()


def test_the_grace_period_outlasts_the_pause_and_the_drain():
    pod = one("DaemonSet", "gpushare")["spec"]["template"]["spec"]
    pause_s = daemon_container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause_s + gpushare_config().server.drain_timeout_s


def test_the_daemonset_takes_a_gpu_on_gpu_nodes_only():
    pod = one("DaemonSet", "gpushare")["spec"]["template"]["spec"]
    assert daemon_container()["resources"]["limits"]["nvidia.com/gpu"] == 1
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in terms[0]["matchExpressions"]
    assert not pod.get("hostIPC") and not pod.get("hostPID")  # not an MPS client (see the manifest's comment)


def test_the_configmap_passes_gpushares_own_config_loader():
    settings = gpushare_config()
    assert settings.server.trust_gateway_headers
    assert str(settings.models_dir) in {m["mountPath"] for m in daemon_container()["volumeMounts"]}
    config_mount = next(m for m in daemon_container()["volumeMounts"] if m["name"] == "config")
    config_path = daemon_container()["args"][daemon_container()["args"].index("--config") + 1]
    assert Path(config_path).parent == Path(config_mount["mountPath"])
    assert Path(config_path).name in one("ConfigMap", "gpushare-config")["data"]
    assert dict((e["name"], e["value"]) for e in init_step()["env"])["CONFIG_FILE"] == config_path


def test_the_init_step_writes_the_digests_of_the_secrets_keys():
    keys = one("Secret", "gpushare-tenant-keys")["stringData"]
    digests = {t.name: t.api_key_sha256 for t in gpushare_config().tenants}
    assert set(keys) == set(digests) == set(TENANT_KEYS)  # one Secret entry per tenant of the ConfigMap
    for tenant, key in TENANT_KEYS.items():
        assert digests[tenant] == [hashlib.sha256(key.encode()).hexdigest()]
    assert any(t.admin for t in gpushare_config().tenants)  # someone may read /metrics
    with pytest.raises(RuntimeError, match="has no key for:\nops"):  # a tenant the Secret forgot: no start
        rendered_config({"chat": "k1" * 12, "batch": "k2" * 12})


def test_the_shipped_config_accepts_no_published_key():
    """As it ships, the ConfigMap holds placeholders gpushare refuses to start with, and the Secret's
    placeholder keys, once written in, are refused too (they are printed in this repository)."""
    template = yaml.safe_load(one("ConfigMap", "gpushare-config")["data"]["gpushare.yaml"])
    with pytest.raises(ConfigError, match=r"tenants\[0\].api_keys\[0\]: sha256: must be followed by 64 hex"):
        parse_settings(template, env={})
    with pytest.raises(ConfigError, match="published placeholder key") as info:
        gpushare_config(one("Secret", "gpushare-tenant-keys")["stringData"])
    assert "change-me" not in str(info.value)  # the message names no key


def test_only_the_init_step_sees_the_secret():
    pod = one("DaemonSet", "gpushare")["spec"]["template"]["spec"]
    secret_volumes = {v["name"] for v in pod["volumes"] if "secret" in v}
    assert secret_volumes == {"tenant-keys"}
    assert {m["name"] for m in daemon_container()["volumeMounts"]}.isdisjoint(secret_volumes)
    written = next(m for m in init_step()["volumeMounts"] if m["name"] == "config")
    read = next(m for m in daemon_container()["volumeMounts"] if m["name"] == "config")
    assert written["mountPath"] == read["mountPath"] and read["readOnly"] and not written.get("readOnly")
    assert next(v for v in pod["volumes"] if v["name"] == "config")["emptyDir"]["medium"] == "Memory"


def test_the_containerfile_builds_what_the_daemonset_runs():
    text = (ROOT / "Containerfile").read_text()
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources and all((ROOT / s).exists() for s in sources)
    assert re.search(r"^EXPOSE 11434$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["gpushare"\]$', text, re.M)
    assert re.search(r"^USER 10001:10001$", text, re.M)
    pod_security = one("DaemonSet", "gpushare")["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsUser"] == 10001 and pod_security["runAsGroup"] == 10001
    assert daemon_container()["args"][0] == "serve"


def test_every_route_rule_sets_or_strips_the_trusted_headers():
    """The config trusts the gateway's headers, so none reaches a pod as a client sent it: each rule's
    RequestHeaderModifier removes or sets both (Gateway API v1 fields), and what it sets is a priority."""
    assert gpushare_config().server.trust_gateway_headers
    rules = one("HTTPRoute")["spec"]["rules"]
    for rule in rules:
        (modifier,) = [f for f in rule.get("filters", []) if f["type"] == "RequestHeaderModifier"]
        check_fields(modifier["requestHeaderModifier"], {"set", "add", "remove"}, set(), "requestHeaderModifier")
        changed = modifier["requestHeaderModifier"]
        assert not changed.get("add"), "add keeps what the client sent"
        set_headers = {h["name"].lower(): h["value"] for h in changed.get("set", [])}
        removed = {name.lower() for name in changed.get("remove", [])}
        assert {FAIRNESS_HEADER, OBJECTIVE_HEADER} <= set(set_headers) | removed, rule
        assert set(set_headers).isdisjoint(removed)
        assert set_headers.get(OBJECTIVE_HEADER, PRIORITIES[-1]) in PRIORITIES
    # Only the lowest priority is set by path: a client may lower its priority, never raise it.
    assert {h["value"] for rule in rules for f in rule.get("filters", []) if f["type"] == "RequestHeaderModifier"
            for h in f["requestHeaderModifier"].get("set", []) if h["name"] == OBJECTIVE_HEADER} <= {PRIORITIES[-1]}
    assert any(m["path"]["value"] == "/" for rule in rules for m in rule["matches"])  # every path is covered


def test_only_the_gateway_and_the_picker_reach_the_pods_port():
    policy = one("NetworkPolicy", "gpushare")["spec"]
    pod_labels = one("DaemonSet", "gpushare")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 11434}]
    assert 11434 in {p["containerPort"] for p in daemon_container()["ports"]}
    peers = rule["from"]
    assert all("ipBlock" not in peer for peer in peers)
    epp_labels = one("Deployment", "gpushare-epp")["spec"]["template"]["metadata"]["labels"]
    gateway = one("HTTPRoute")["spec"]["parentRefs"][0]["name"]
    picker = [p for p in peers if p.get("podSelector", {}).get("matchLabels", {}).items() <= epp_labels.items()
              and "namespaceSelector" not in p]
    gateways = [p for p in peers if p.get("podSelector", {}).get("matchLabels") ==
                {"gateway.networking.k8s.io/gateway-name": gateway}]
    assert len(picker) == len(gateways) == 1 and len(peers) == 2, peers
    assert gateways[0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "gpushare"}
