"""The Helm chart in infra/helm/stoker, rendered by helmlite (no helm binary is installable here) with
the default values and with every optional feature on, then checked object by object: against the
Kubernetes API schemas (kubernetes-validate, strict: an unknown or misplaced field fails), and
against what Stoker's processes need and may have: their command lines, the admin key from a
Secret, RBAC exactly as the processes use it, least-privilege security contexts, probes, and
Services, selectors and the autoscaler pointing at the right pods.
"""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.infra.helmlite import RequiredError, manifests, render_chart
from tests.kube.accounts import DECLARED

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "infra" / "helm" / "stoker"
PACKAGES = ("platform/stoker", "activator", "warm_pool", "snapshots")
NAMESPACE = "inference"
KUBERNETES = "1.33"  # a recent release whose schemas kubernetes-validate bundles


def oldest_kubernetes() -> str:
    """The oldest release Chart.yaml's kubeVersion admits (">=1.29.0-0" -> "1.29")."""
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    return re.fullmatch(r">=(\d+\.\d+)\.0-0", floor).group(1)


DEFAULTS = {"adminKey": {"existingSecret": "stoker-admin"}}
EVERYTHING = {
    "adminKey": {"value": "sk-admin-test", "key": "token"},
    "s3": {"endpointUrl": "http://minio.storage:9000", "existingSecret": "s3-creds"},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "imagePullSecrets": [{"name": "regcred"}],
    "node": {
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "gateway": {"nodeSelector": {"pool": "cpu"}},
    "controller": {"replicas": 3},
    "store": {"hostPath": "/nvme0/stoker"},
    "engineImage": "registry.example/stoker-engine:1.2.3",
    "image": {"tag": "1.2.3"},
}
RENDERS = {"defaults": DEFAULTS, "everything": EVERYTHING}


def render(values: dict) -> list[dict]:
    return manifests(render_chart(CHART, values, release="stoker", namespace=NAMESPACE))


@pytest.fixture(scope="module", params=list(RENDERS))
def objects(request) -> list[dict]:
    return render(RENDERS[request.param])


@pytest.fixture(scope="module")
def everything() -> list[dict]:
    return render(EVERYTHING)


def one(objects: list[dict], kind: str, component: str | None = None) -> dict:
    found = [
        o
        for o in objects
        if o["kind"] == kind
        and (component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {len(found)}"
    return found[0]


def admin_secret(objects: list[dict]) -> dict:
    """The admin key's Secret: the one Secret that is not a TLS one (tls.yaml)."""
    (found,) = [o for o in objects if o["kind"] == "Secret" and o["type"] != "kubernetes.io/tls"]
    return found


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("StatefulSet", "Deployment", "DaemonSet")]


def walk(node: object):
    """Every mapping in a manifest, nested ones included."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


# --- every object is one the API server accepts -------------------------------------------------


def test_the_chart_renders_the_objects_stoker_needs(objects):
    kinds = sorted(o["kind"] for o in objects if o["kind"] not in ("Secret", "ServiceMonitor"))
    assert kinds == sorted(
        ["ClusterRole"] * 2
        + ["ClusterRoleBinding"] * 2
        + ["DaemonSet", "Deployment", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy"]
        + ["PodDisruptionBudget", "Role", "RoleBinding"]
        + ["Service"] * 2
        + ["ServiceAccount"] * 3
    )
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("version", [oldest_kubernetes(), KUBERNETES])
def test_every_builtin_object_passes_the_strict_api_schema(objects, version):
    for obj in objects:
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_strict_schema_catches_a_misplaced_field(everything):
    """Guards the test above: a field where the API has none must fail, not pass silently."""
    broken = yaml.safe_load(yaml.safe_dump(one(everything, "Deployment", "gateway")))
    broken["spec"]["template"]["spec"]["containers"][0]["probe"] = {"path": "/healthz"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


# The fields of monitoring.coreos.com/v1 ServiceMonitor this chart uses, as the CRD defines them.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["key", "operator"],
                                "additionalProperties": False,
                                "properties": {
                                    "key": {"type": "string"},
                                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                    "values": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                        },
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "scheme": {"enum": ["http", "https"]},
                            "tlsConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "serverName": {"type": "string"},
                                    "ca": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "secret": {
                                                "type": "object",
                                                "required": ["key"],
                                                "additionalProperties": False,
                                                "properties": {
                                                    "name": {"type": "string"},
                                                    "key": {"type": "string"},
                                                },
                                            }
                                        },
                                    },
                                },
                            },
                            "authorization": {
                                "type": "object",
                                "required": ["credentials"],
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": {
                                        "type": "object",
                                        "required": ["key"],
                                        "additionalProperties": False,
                                        "properties": {"name": {"type": "string"}, "key": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_the_service_monitor_is_off_by_default():
    assert not [o for o in render(DEFAULTS) if o["kind"] == "ServiceMonitor"]


def test_the_service_monitor_scrapes_the_controller_and_gateways_with_the_admin_key(everything):
    monitors = [o for o in everything if o["kind"] == "ServiceMonitor"]
    secret = admin_secret(everything)
    scraped = {}
    for monitor in monitors:
        jsonschema.validate(monitor, SERVICE_MONITOR)
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        (endpoint,) = monitor["spec"]["endpoints"]
        for s in everything:
            if s["kind"] == "Service" and selects(monitor["spec"]["selector"], s):
                assert endpoint["port"] in [p["name"] for p in s["spec"]["ports"]]
                scraped[s["metadata"]["labels"]["app.kubernetes.io/component"]] = endpoint
        assert endpoint["path"] == "/metrics" and endpoint["authorization"]["type"] == "Bearer"
        assert endpoint["authorization"]["credentials"] == {
            "name": secret["metadata"]["name"],
            "key": "token",
        }
    assert sorted(scraped) == ["controller", "gateway"] and len(monitors) == 2  # each scraped once
    # The controller serves HTTPS (TLS is on by default): verified against the CA, by its Service name.
    controller = scraped["controller"]
    assert controller["scheme"] == "https"
    assert controller["tlsConfig"] == {
        "serverName": one(everything, "Service", "controller")["metadata"]["name"],
        "ca": {"secret": {"name": "stoker-tls", "key": "ca.crt"}},
    }
    assert "scheme" not in scraped["gateway"]


def selects(selector: dict, obj: dict) -> bool:
    """A LabelSelector (matchLabels and In expressions, all this chart uses) against obj's labels."""
    labels = obj["metadata"]["labels"]
    matched = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        matched = matched and labels.get(expression["key"]) in expression["values"]
    return matched


# --- the admin key -----------------------------------------------------------------------------


def test_rendering_without_an_admin_key_fails_and_says_what_to_set():
    with pytest.raises(RequiredError, match=r"adminKey\.existingSecret.*adminKey\.value"):
        render({})


def test_values_yaml_holds_no_admin_key():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["adminKey"]["value"] == "" and values["adminKey"]["existingSecret"] == ""


def test_an_existing_secret_is_used_and_none_is_created():
    objects = render(DEFAULTS)
    assert not [o for o in objects if o["kind"] == "Secret" and o["type"] != "kubernetes.io/tls"]
    for workload in workloads(objects):
        ref = env(container(workload))["STOKER_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "stoker-admin", "key": "admin-key"}


def test_a_given_value_becomes_a_chart_secret_every_process_reads(everything):
    secret = admin_secret(everything)
    assert secret["stringData"] == {"token": "sk-admin-test"}
    for workload in workloads(everything):
        ref = env(container(workload))["STOKER_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "token"}


# --- what each process runs with --------------------------------------------------------------


def test_the_controller_runs_on_kubernetes_with_the_engine_image(everything):
    controller = one(everything, "Deployment", "controller")
    assert controller["spec"]["replicas"] == 3
    assert container(controller)["args"] == [
        "controller",
        "--host", "0.0.0.0",
        "--port", "8081",
        "--data-dir", "/var/lib/stoker",
        "--backend", "kubernetes",
        "--namespace", NAMESPACE,
        "--engine-image", "registry.example/stoker-engine:1.2.3",
        "--store-path", "/nvme0/stoker",
        "--owner", "stoker",
        "--s3-secret", "s3-creds",
        "--tls-cert", "/etc/stoker/tls/tls.crt",
        "--tls-key", "/etc/stoker/tls/tls.key",
        "--tls-ca", "/etc/stoker/tls/ca.crt",
        "--engine-tls-secret", "stoker-engine-tls",
    ]  # fmt: skip


def test_two_controllers_by_default_one_leading_by_the_lease():
    """No --identity: each replica's name in the Lease is its hostname (its pod's name) with a
    random suffix (cli/planes.py), unique per Deployment pod; --lease-name is the default."""
    controller = one(render(DEFAULTS), "Deployment", "controller")
    assert controller["spec"]["replicas"] == 2
    args = container(controller)["args"]
    assert "--identity" not in args and "--lease-name" not in args


def test_no_volume_claims_and_no_statefulset_anywhere(objects):
    """The controller's state is in the API server: its data dir is an emptyDir, scratch only."""
    assert not [o for o in objects if o["kind"] in ("StatefulSet", "PersistentVolumeClaim")]
    for obj in objects:
        for mapping in walk(obj):
            assert not mapping.keys() & {"volumeClaimTemplates", "persistentVolumeClaim"}, obj["kind"]
    controller = one(objects, "Deployment", "controller")
    mounts = {m["mountPath"]: m["name"] for m in container(controller)["volumeMounts"]}
    volumes = {v["name"]: v for v in controller["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/var/lib/stoker"]] == {"name": mounts["/var/lib/stoker"], "emptyDir": {}}
    assert "persistence" not in yaml.safe_load((CHART / "values.yaml").read_text())["controller"]


def test_a_controller_rollout_can_replace_the_leader(objects):
    """Only the leader is ever Ready (a standby does not listen), so a rollout that must keep any
    pod available keeps the old leader for ever, and the new pods wait for its Lease: maxUnavailable
    is all of them, and one new pod is started before the old ones go."""
    strategy = one(objects, "Deployment", "controller")["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "100%"}}


def test_the_controllers_prefer_different_nodes(objects):
    controller = one(objects, "Deployment", "controller")
    affinity = controller["spec"]["template"]["spec"]["affinity"]
    assert affinity.keys() == {"podAntiAffinity"}
    (preferred,) = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == controller["spec"]["selector"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity["podAntiAffinity"]


def test_no_disruption_budget_holds_the_controller(objects):
    """A budget counts Ready pods, and only the leader is Ready: minAvailable 1 would refuse every
    eviction of the leader (a drain of its node waits for ever). The leader, evicted, releases the
    Lease and the standby takes it."""
    pod = one(objects, "Deployment", "controller")["spec"]["template"]
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert budgets and not [b for b in budgets if selects(b["spec"]["selector"], pod)]


def test_engine_pods_and_the_node_agent_share_the_nodes_store(everything):
    """The controller mounts `--store-path` as a hostPath at that same path in each engine pod
    (warm_pool/backends/kube_pod.py), so it must name the directory the node agent keeps."""
    args = container(one(everything, "Deployment", "controller"))["args"]
    node = one(everything, "DaemonSet", "node")
    (host,) = [v["hostPath"] for v in node["spec"]["template"]["spec"]["volumes"] if "hostPath" in v]
    assert args[args.index("--store-path") + 1] == host["path"]


def test_gateways_and_node_agents_reach_the_controller_through_its_service(everything):
    service = one(everything, "Service", "controller")
    url = f"https://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    gateway = container(one(everything, "Deployment", "gateway"))
    node = container(one(everything, "DaemonSet", "node"))
    ca = ["--tls-ca", "/etc/stoker/tls/ca.crt"]
    assert gateway["args"] == ["gateway", "--host", "0.0.0.0", "--port", "8080", "--controller", url, *ca]
    assert node["args"] == [
        "node",
        "--store", "/var/lib/stoker-store",
        "--controller", url,
        "--node-name", "$(NODE_NAME)",
        "--port", "8082",
        *ca,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "component",
    [
        "controller",
        "gateway",
        "node",
    ],
)
def test_each_command_line_is_one_the_stoker_cli_accepts(everything, component):
    from stoker.cli.main import build_parser

    (workload,) = [
        w
        for w in workloads(everything)
        if w["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    c = container(workload)
    parsed = build_parser().parse_args(c["args"])
    assert parsed.command == component
    assert parsed.port == c["ports"][0]["containerPort"]


def test_the_node_agent_knows_its_node_and_mounts_the_nvme_store(everything):
    node = one(everything, "DaemonSet", "node")
    assert env(container(node))["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    volumes = {v["name"]: v for v in node["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in container(node)["volumeMounts"] if m["mountPath"] == "/var/lib/stoker-store")
    assert volumes[mount["name"]]["hostPath"] == {"path": "/nvme0/stoker", "type": "Directory"}
    pod = node["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == EVERYTHING["node"]["nodeSelector"]
    assert pod["tolerations"] == EVERYTHING["node"]["tolerations"]


def test_object_storage_settings_reach_the_processes_that_move_snapshots(everything):
    for workload in (one(everything, "Deployment", "controller"), one(everything, "DaemonSet")):
        variables = env(container(workload))
        assert variables["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert variables[name]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": name}
    assert not env(container(one(everything, "Deployment", "gateway"))).keys() & {
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
    }


def test_every_variable_the_chart_sets_is_one_stoker_reads(everything):
    """A misspelt variable is silently ignored by the process, so each name must occur in the
    packages' source; the AWS credentials are botocore's own, NODE_NAME goes into the node agent's
    argv, HOME is the system's, NVIDIA_VISIBLE_DEVICES the NVIDIA container runtime's."""
    source = "\n".join(p.read_text() for d in PACKAGES for p in (REPO / d).rglob("*.py"))
    names = {n for w in workloads(everything) for n in env(container(w))}
    others = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "NODE_NAME", "HOME", "NVIDIA_VISIBLE_DEVICES"}
    assert others <= names
    for name in names - others:
        assert re.search(rf"[\"']{name}[\"']", source), name


def test_without_object_storage_settings_no_s3_variables_are_set():
    for workload in workloads(render(DEFAULTS)):
        assert not {n for n in env(container(workload)) if "S3" in n or n.startswith("AWS_")}


def test_images_come_from_values(everything):
    assert {container(w)["image"] for w in workloads(everything)} == {"stoker:1.2.3"}
    assert {container(w)["image"] for w in workloads(render(DEFAULTS))} == {"stoker:0.1.0"}
    for workload in workloads(everything):
        assert workload["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


# --- RBAC: exactly what the processes use -----------------------------------------------------
#
# The expected rules are derived from what the code says it calls (`API_CALLS`, declared beside the
# calls, gathered per component in tests/kube/accounts.py), not copied here: a static table is
# what this test needs, since it renders the chart alone, in any order and on any worker. The
# table cannot drift from the code either: tests/kube runs every process against a fake API
# server that enforces this chart's RBAC and fails any test whose processes made a call their
# code does not declare, and tests/kube/test_rbac.py drives every declared call.


def granted(roles: list[dict]) -> list[tuple[str, str, str]]:
    """(group, resource, verb) for every verb the roles' rules grant."""
    return [
        (group, resource, verb)
        for role in roles
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    ]


def roles_of(objects: list[dict], kind: str, component: str) -> list[dict]:
    return [
        o
        for o in objects
        if o["kind"] == kind and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]


@pytest.mark.parametrize("component", sorted(DECLARED))
def test_rbac_grants_exactly_the_calls_the_code_makes(objects, component):
    for kind, namespaced in (("Role", True), ("ClusterRole", False)):
        grants = granted(roles_of(objects, kind, component))
        expected = {(c.group, c.resource, c.verb) for c in DECLARED[component] if c.namespaced == namespaced}
        assert sorted(set(grants)) == sorted(expected), f"{component}'s {kind}"
        assert len(grants) == len(set(grants)), f"{component}'s {kind} grants a verb twice"
        for rule in (r for role in roles_of(objects, kind, component) for r in role["rules"]):
            assert not rule.get("resourceNames") and not rule.get("nonResourceURLs")


def test_rbac_has_no_wildcards(objects):
    for role in (o for o in objects if o["kind"] in ("Role", "ClusterRole")):
        for rule in role["rules"]:
            granted = [*rule["apiGroups"], *rule["resources"], *rule["verbs"], *rule.get("resourceNames", [])]
            assert not [g for g in granted if "*" in g], role["metadata"]["name"]


def test_each_binding_gives_its_role_to_its_own_service_account_only(objects):
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    for binding in bindings:
        kind = binding["roleRef"]["kind"]
        role = next(
            o for o in objects if o["kind"] == kind and o["metadata"]["name"] == binding["roleRef"]["name"]
        )
        (subject,) = binding["subjects"]
        account = accounts[subject["name"]]
        assert subject == {"kind": "ServiceAccount", "name": subject["name"], "namespace": NAMESPACE}
        component = role["metadata"]["labels"]["app.kubernetes.io/component"]
        assert account["metadata"]["labels"]["app.kubernetes.io/component"] == component
    bound = {b["subjects"][0]["name"] for b in bindings}
    assert one(objects, "ServiceAccount", "gateway")["metadata"]["name"] not in bound


def test_cluster_wide_names_carry_the_namespace(objects):
    for obj in objects:
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["name"].startswith(f"{NAMESPACE}-")


def test_each_workload_runs_as_its_own_service_account(objects):
    for workload in workloads(objects):
        account = workload["spec"]["template"]["spec"]["serviceAccountName"]
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        assert account == one(objects, "ServiceAccount", component)["metadata"]["name"]


def test_the_gateway_has_no_kubernetes_token(objects):
    assert one(objects, "ServiceAccount", "gateway")["automountServiceAccountToken"] is False
    pod = one(objects, "Deployment", "gateway")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False


# --- security contexts, probes, resources ------------------------------------------------------

CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def test_every_container_runs_with_least_privilege(objects):
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "hostNetwork" not in pod and "hostPID" not in pod
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"] == CONTAINER_SECURITY, c["name"]


def test_a_read_only_root_still_has_a_writable_tmp_and_home(objects):
    for workload in workloads(objects):
        c = container(workload)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        tmp = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
        assert volumes[tmp] == {"name": tmp, "emptyDir": {}}
        assert env(c)["HOME"]["value"] == "/tmp"


def test_every_container_is_probed_on_healthz_of_its_own_port(objects):
    for workload in workloads(objects):
        c = container(workload)
        (port,) = c["ports"]
        assert c["args"][c["args"].index("--port") + 1] == str(port["containerPort"])
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        probes = ("readinessProbe",) if component == "controller" else ("readinessProbe", "livenessProbe")
        for probe in probes:
            # The controller serves HTTPS (TLS on by default); the kubelet does not verify a probe's certificate.
            https = {"scheme": "HTTPS"} if component == "controller" else {}
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": port["name"], **https}


def test_a_standby_controller_is_never_killed_for_standing_by(objects):
    """A standby does not listen until it holds the Lease (build_controller's lifespan), so any
    liveness probe on its port would restart it every minute while it waits: readiness only."""
    c = container(one(objects, "Deployment", "controller"))
    assert "livenessProbe" not in c and "startupProbe" not in c
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_every_container_requests_cpu_and_memory_from_values(objects):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for workload in workloads(objects):
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        assert container(workload)["resources"] == values[component]["resources"]
        assert container(workload)["resources"]["requests"].keys() == {"cpu", "memory"}


# --- selectors, Services, the autoscaler ------------------------------------------------------


def test_each_workload_selects_its_own_pods_and_no_others(objects):
    for workload in workloads(objects):
        selector = workload["spec"]["selector"]
        assert selects(selector, workload["spec"]["template"])
        assert [w for w in workloads(objects) if selects(selector, w["spec"]["template"])] == [workload]


def test_each_service_selects_exactly_one_workload_and_targets_its_port(objects):
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = {"matchLabels": service["spec"]["selector"]}
        (workload,) = [w for w in workloads(objects) if selects(selector, w["spec"]["template"])]
        assert workload["metadata"]["labels"] == service["metadata"]["labels"]
        ports = {p["name"] for p in container(workload)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_the_gateways_are_scaled_by_cpu_and_kept_up_through_drains(objects):
    gateway = one(objects, "Deployment", "gateway")
    hpa = one(objects, "HorizontalPodAutoscaler", "gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "apps/v1",
        "Deployment",
        gateway["metadata"]["name"],
    )
    assert "replicas" not in gateway["spec"]  # the HPA owns the count
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    pdb = one(objects, "PodDisruptionBudget", "gateway")
    assert pdb["spec"]["selector"] == gateway["spec"]["selector"]
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]  # a drain can always evict one


# --- who may reach the engine pods ---------------------------------------------------------------


def engine_pod(owner: str) -> dict:
    """An engine pod as the controller's Kubernetes backend creates it for a release named `owner`
    (the chart passes `--owner <release>`), on the backend's own engine port."""
    from warm_pool.backends.base import Placement
    from warm_pool.backends.kube_pod import PodSettings, pod_manifest
    from warm_pool.launch import vllm_spec

    settings = PodSettings(image="stoker-engine:1", store_path="/mnt/nvme/stoker", owner=owner)
    placement = Placement("chat-1a2b3c4d", "chat", "ab" * 32, None, "vllm", 1, "0.0.0.0", 8000, "k")
    spec = vllm_spec(Path(settings.store_path) / ("ab" * 32), 8000, "chat", [0], api_key="k")
    return pod_manifest(settings, placement, spec, started_at=0.0)


def test_only_the_controller_and_the_gateways_reach_engine_pods_on_the_engine_port(objects):
    policy = one(objects, "NetworkPolicy")
    spec = policy["spec"]
    pod = engine_pod("stoker")
    # It selects this release's engine pods, and none of the chart's own pods or another release's.
    assert selects(spec["podSelector"], pod)
    assert not selects(spec["podSelector"], engine_pod("other-release"))
    assert not [w for w in workloads(objects) if selects(spec["podSelector"], w["spec"]["template"])]
    # Ingress only, and from exactly the controller's and the gateways' pods, on the engine port.
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert peer.keys() == {"podSelector"}  # this namespace only: no namespaceSelector, no ipBlock
    allowed = [w for w in workloads(objects) if selects(peer["podSelector"], w["spec"]["template"])]
    assert sorted((w["kind"], w["metadata"]["labels"]["app.kubernetes.io/component"]) for w in allowed) == [
        ("Deployment", "controller"),
        ("Deployment", "gateway"),
    ]
    [port] = pod["spec"]["containers"][0]["ports"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port["containerPort"]}]


def test_the_network_policy_can_be_turned_off():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["networkPolicy"] == {"enabled": True}
    off = render({**DEFAULTS, "networkPolicy": {"enabled": False}})
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]


# --- the chart's own files ---------------------------------------------------------------------


def test_chart_yaml_is_a_helm_3_chart():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "stoker" and chart["type"] == "application"


def test_the_notes_say_where_the_gateway_is(everything):
    notes = render_chart(CHART, EVERYTHING, namespace=NAMESPACE)["NOTES.txt"]
    assert f"http://stoker-gateway.{NAMESPACE}:8080/v1" in notes
    assert "jsonpath='{.data.token}'" in notes


def test_the_values_and_the_notes_say_which_pod_security_label_the_namespace_needs(everything):
    """The engine pods' and the node agents' hostPath store fits only `privileged`
    (tests/kube/test_fake_podsecurity.py: and nothing else of theirs needs it)."""
    notes = render_chart(CHART, EVERYTHING, namespace=NAMESPACE)["NOTES.txt"]
    assert f"kubectl label namespace {NAMESPACE} pod-security.kubernetes.io/enforce=privileged" in notes
    assert "hostPath" in notes
    values = (CHART / "values.yaml").read_text()
    assert "pod-security.kubernetes.io/enforce: privileged" in values and "hostPath" in values


def test_object_names_stay_within_kubernetes_limits_for_the_longest_release_name():
    long_name = "r" * 53  # the longest release name Helm accepts
    objects = manifests(render_chart(CHART, DEFAULTS, release=long_name, namespace=NAMESPACE))
    for obj in objects:
        name = obj["metadata"]["name"]
        assert len(name) <= 63 and not name.endswith("-"), name
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
