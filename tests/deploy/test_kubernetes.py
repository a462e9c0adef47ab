"""The Kubernetes package (deploy/kubernetes), checked offline.

Every overlay, and the overlays with the opt-in components, is rendered with
``kubectl kustomize`` and each manifest validated against the Kubernetes 1.30
OpenAPI schemas that ``kubernetes-validate`` ships (strict: an unknown field
is an error). Then what a user relies on: the server's probes and Service
reach the port it listens on (liveness on /healthz, readiness on /readyz),
the server runs several replicas on several nodes with a lease bound that the
bundled database's TCP keepalives honour, the agents find the server by the
Service's name, every Secret, ConfigMap, volume claim and service account a pod names
is in the render, the agent gets the node's GPUs, images are pinned, nothing
runs privileged, and the shell and Python embedded in the manifests (the
credentials check, the agent's liveness probe, the switch label wrapper)
do what they say. Nothing is applied to a cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import pytest

yaml = pytest.importorskip("yaml")

from tidal import settings  # noqa: E402
from tidal.control.credentials import Credentials  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KDIR = REPO / "deploy" / "kubernetes"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
K8S_VERSION = "1.30"  # the schemas validated against
KUBECTL = shutil.which("kubectl")
OVERLAYS = sorted(p.name for p in (KDIR / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = sorted(p.name for p in (KDIR / "components").iterdir() if (p / "kustomization.yaml").exists())

# docs/deploy.md's patch for nodes with 4 GPUs
FOUR_GPUS = """\
- op: replace
  path: /spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu
  value: 4
- op: replace
  path: /spec/template/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms/0/matchExpressions/0/values
  value: ["4"]
"""
# what is rendered: each overlay alone, and overlays with components or patches
VARIANTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    **{o: (o, (), "") for o in OVERLAYS},
    "external-postgres+switch-label+network-policy":
        ("external-postgres", ("switch-label", "network-policy"), ""),
    "bundled-postgres+pod-network+network-policy+switch-label":
        ("bundled-postgres", ("pod-network", "network-policy", "switch-label"), ""),
    "bundled-postgres+4-gpus": ("bundled-postgres", (), FOUR_GPUS),
}
# made by Kubernetes in every namespace, so never in a render
BUILTIN_CONFIGMAPS = {"kube-root-ca.crt"}
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found: the manifests cannot be rendered")


# -- rendering ----------------------------------------------------------------------


@lru_cache(maxsize=None)
def _render_dir(path: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run([KUBECTL, "kustomize", path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@pytest.fixture(scope="session")
def variant_dirs(tmp_path_factory) -> dict[str, str]:
    """Each variant's kustomization directory; the combinations are written
    to temporary overlays (kustomize wants relative paths to them)."""
    dirs = {}
    for name, (overlay, components, patch) in VARIANTS.items():
        if not components and not patch:
            dirs[name] = str(KDIR / "overlays" / overlay)
            continue
        d = tmp_path_factory.mktemp("overlay")
        rel = os.path.relpath(KDIR, d)
        k: dict[str, Any] = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [f"{rel}/overlays/{overlay}"],
            "components": [f"{rel}/components/{c}" for c in components],
        }
        if patch:
            k["patches"] = [{"target": {"kind": "DaemonSet", "name": "tidal-agent"}, "patch": patch}]
        (d / "kustomization.yaml").write_text(yaml.safe_dump(k))
        dirs[name] = str(d)
    return dirs


@pytest.fixture(params=list(VARIANTS))
def docs(request, variant_dirs) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl not found: the manifests cannot be rendered")
    return [dict(d) for d in _render_dir(variant_dirs[request.param])]


def one(docs: list[dict], kind: str, name_prefix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix!r}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(spec: dict, init: bool = True) -> list[dict]:
    return list(spec.get("containers", [])) + (list(spec.get("initContainers", [])) if init else [])


def container(spec: dict, name: str) -> dict:
    return next(c for c in containers(spec) if c["name"] == name)


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def arg_after(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} not in {args}"
    return args[args.index(flag) + 1]


def expand(value: str, c: dict) -> str:
    """$(VAR) replaced by the container's literal env value, as the kubelet does."""
    env = {k: e["value"] for k, e in env_of(c).items() if "value" in e}
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def server_parts(docs: list[dict]) -> tuple[dict, dict, dict]:
    dep = one(docs, "Deployment", "tidal-server")
    return dep, container(pod_spec(dep), "server"), one(docs, "Service", "tidal-server")


def agent_parts(docs: list[dict]) -> tuple[dict, dict]:
    ds = one(docs, "DaemonSet", "tidal-agent")
    return ds, container(pod_spec(ds), "agent")


def container_port(c: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    assert port in named, f"port {port!r} is not a named port of container {c['name']}"
    return named[port]


def configmap_env(docs: list[dict], c: dict) -> dict[str, str]:
    """The container's environment from its ConfigMaps and literal values."""
    out: dict[str, str] = {}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            out.update(one(docs, "ConfigMap", src["configMapRef"]["name"]).get("data", {}))
    out.update({k: e["value"] for k, e in env_of(c).items() if "value" in e})
    return out


# -- schema ---------------------------------------------------------------------------


def test_schema_validator_installed():
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed: pip install -e '.[dev]'")


@lru_cache(maxsize=None)
def _schema_errors(doc_json: str) -> str:
    """'' if the manifest is valid (cached: variants share most manifests)."""
    import kubernetes_validate as kv

    d = json.loads(doc_json)
    try:
        kv.validate(d, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        return f"{d['kind']}/{d['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}"
    except kv.SchemaNotFoundError as e:
        return f"{d['kind']}/{d['metadata']['name']}: {e.message}"
    return ""


def test_manifests_match_the_kubernetes_schemas(docs):
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed: pip install -e '.[dev]'")
    errors = [e for e in (_schema_errors(json.dumps(d, sort_keys=True)) for d in docs) if e]
    assert not errors, "\n".join(errors)


def test_the_validator_catches_a_misspelt_field(docs):
    """The schemas are strict: a probe under a wrong name is an error."""
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed: pip install -e '.[dev]'")
    ds, _ = agent_parts(docs)
    bad = json.loads(json.dumps(ds))
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["livenesProbe"] = c.pop("livenessProbe")
    assert "livenesProbe" in _schema_errors(json.dumps(bad, sort_keys=True))


def test_everything_is_in_the_tidal_namespace(docs):
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] not in cluster_scoped} == {"tidal"}
    assert one(docs, "Namespace")["metadata"]["name"] == "tidal"


# -- the server ---------------------------------------------------------------------------


def test_server_probes_and_service_reach_the_port_it_listens_on(docs):
    dep, c, svc = server_parts(docs)
    listen = int(arg_after(c["args"], "--port"))
    assert arg_after(c["args"], "--host") == "0.0.0.0"
    # liveness (and startup) on the cheap /healthz; readiness on /readyz, which asks the database
    paths = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in paths.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path, probe
        assert container_port(c, get["port"]) == listen, probe
    # the probe waits longer than the server waits for the database
    db_timeout = float(configmap_env(docs, c).get(settings.READY_DB_TIMEOUT_S.name, settings.READY_DB_TIMEOUT_S.default))
    assert c["readinessProbe"]["timeoutSeconds"] > db_timeout
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 8470
    assert container_port(c, port["targetPort"]) == listen
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_server_is_scraped_by_prometheus_on_its_metrics(docs):
    dep, c, _ = server_parts(docs)
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == int(arg_after(c["args"], "--port"))
    assert ann["prometheus.io/path"] == "/metrics"


def test_the_probed_paths_are_the_servers_routes(tmp_path):
    from tidal.control.db import Store
    from tidal.control.server import create_app

    from fastapi.testclient import TestClient

    client = TestClient(create_app(Store(f"sqlite:///{tmp_path / 's.db'}"), home=tmp_path, start_loop=False))
    for path in ("/healthz", "/readyz", "/metrics"):  # no token, as a kubelet or Prometheus asks
        assert client.get(path).status_code == 200, path


def test_server_runs_several_replicas_on_several_nodes(docs):
    """Replicas over PostgreSQL (leader election), spread over nodes, sharing
    their home (the logs), rolled one at a time, kept by a disruption budget."""
    dep, c, _ = server_parts(docs)
    assert dep["spec"]["replicas"] >= 2
    roll = dep["spec"]["strategy"]
    assert roll["type"] == "RollingUpdate" and roll["rollingUpdate"]["maxUnavailable"] == 0
    assert c["resources"]["requests"] and c["resources"]["limits"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    (term,) = pod_spec(dep)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    claim = next(v for v in pod_spec(dep)["volumes"] if v["name"] == "home")["persistentVolumeClaim"]["claimName"]
    assert one(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    pdb = one(docs, "PodDisruptionBudget", "tidal-server")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # the store is PostgreSQL (a SQLite file has one replica): the URL of every overlay says so
    import base64

    db = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("tidal-db-"))
    assert urlparse(base64.b64decode(db["data"]["url"]).decode()).scheme == "postgresql+psycopg"


def _lease_s(docs: list[dict]) -> float:
    _, c, _ = server_parts(docs)
    raw = configmap_env(docs, c).get(settings.LEADER_LEASE_S.name)
    return float(raw) if raw else settings.LEADER_LEASE_S.default


def test_the_lease_bound_is_set_and_the_bundled_postgres_ends_silent_sessions_within_it(docs):
    """The server's lease bound is in its settings; the bundled PostgreSQL
    drops a silent client's session (and its advisory lock) within it, by
    keepalives alone and by its TCP user timeout, for every client."""
    lease = _lease_s(docs)
    assert 5 <= lease <= 30
    if not any(d["kind"] == "StatefulSet" for d in docs):
        pytest.skip("no bundled database in this variant (the server sets the same per session)")
    pg = container(pod_spec(one(docs, "StatefulSet", "tidal-postgres")), "postgres")
    args = pg["args"]
    conf = dict(a.split("=", 1) for flag, a in zip(args[::2], args[1::2]) if flag == "-c")
    assert len(conf) * 2 == len(args), args
    idle, interval, count = (int(conf[f"tcp_keepalives_{k}"]) for k in ("idle", "interval", "count"))
    user_timeout_s = int(conf["tcp_user_timeout"]) / 1000
    assert idle + interval * count <= lease
    assert 0 < user_timeout_s + interval <= lease


def test_server_credentials_and_database_come_from_secrets(docs):
    dep, c, _ = server_parts(docs)
    env = env_of(c)
    admin = env["TIDAL_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert admin["name"].startswith("tidal-credentials") and admin["key"] == "admin.token"
    db = env["DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert db["name"].startswith("tidal-db") and db["key"] == "url"
    assert arg_after(c["args"], "--db") == "$(DATABASE_URL)"
    home = env["TIDAL_HOME"]["value"]
    # server.secret is installed into $TIDAL_HOME (writable) by the init
    # container from the Secret, mounted elsewhere: the server chmods it
    spec = pod_spec(dep)
    init = container(spec, "install-credentials")
    assert env_of(init)["TIDAL_HOME"]["value"] == home
    creds = env_of(init)["CREDENTIALS_DIR"]["value"]
    vol = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert vol["credentials"] == creds and vol["home"] == home
    secret_vol = next(v for v in spec["volumes"] if v["name"] == "credentials")["secret"]
    assert secret_vol["secretName"].startswith("tidal-credentials")
    assert {i["key"] for i in secret_vol["items"]} == {"server.secret", "agent.token"}
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["home"] == home
    assert not any(m["mountPath"] == creds for m in c["volumeMounts"]), "the server needs no secret file"


def test_settings_are_known_tidal_variables(docs):
    """A TIDAL_* name that tidal does not read (a typo) is an error."""
    known = {s.name for s in settings.all_settings()}
    for w in (d for d in docs if d["kind"] in WORKLOADS):
        for c in containers(pod_spec(w)):
            names = set(env_of(c)) | set(configmap_env(docs, c))
            unknown = {n for n in names if n.startswith("TIDAL_")} - known
            assert not unknown, f"{w['metadata']['name']}/{c['name']}: {unknown}"


# -- the agents ---------------------------------------------------------------------------


def test_agent_finds_the_server_by_its_service_name(docs):
    _, c, svc = server_parts(docs)
    _, agent = agent_parts(docs)
    url = urlparse(arg_after(agent["args"], "--server"))
    ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
    assert url.scheme == "http"
    assert url.hostname in (f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local")
    assert url.port == svc["spec"]["ports"][0]["port"]
    # job masters get the server's advertised address: the same name
    assert configmap_env(docs, c)["TIDAL_ADVERTISE_ADDR"] == url.hostname


def test_agent_joins_with_the_token_the_docs_tell_you_to_create(docs):
    _, agent = agent_parts(docs)
    ref = env_of(agent)["TIDAL_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = one(docs, "Secret", ref["name"])
    assert ref["name"].startswith("tidal-credentials-") and ref["key"] == "agent.token"
    assert ref["key"] in secret["data"]
    doc = DEPLOY_DOC.read_text()
    for word in ("tidal-credentials", "agent.token", "make-secrets.sh", "tidal agent-token"):
        assert word in doc, f"docs/deploy.md does not mention {word}"


def test_agent_is_named_after_its_node_and_advertises_a_reachable_address(docs):
    ds, agent = agent_parts(docs)
    spec, env = pod_spec(ds), env_of(agent)
    assert arg_after(agent["args"], "--name") == "$(NODE_NAME)"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert arg_after(agent["args"], "--advertise-addr") == "$(NODE_IP)"
    field = env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"]
    if spec.get("hostNetwork"):
        assert field == "status.hostIP"
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"  # else the Service name does not resolve
    else:
        assert field == "status.podIP"
        assert spec.get("dnsPolicy", "ClusterFirst") == "ClusterFirst"


def test_agent_gets_all_gpus_of_the_nodes_it_is_placed_on(docs):
    ds, agent = agent_parts(docs)
    spec = pod_spec(ds)
    gpus = int(agent["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1
    # placed only on nodes with exactly that many GPUs (else it stays Pending)
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    for term in terms:
        count = [e for e in term["matchExpressions"] if e["key"] == "nvidia.com/gpu.count"]
        assert count and count[0]["operator"] == "In" and count[0]["values"] == [str(gpus)]
    assert any(t.get("key") == "nvidia.com/gpu" and t.get("operator") == "Exists" for t in spec["tolerations"])
    # no memory/CPU limit: the job processes share the agent's cgroup
    assert set(agent["resources"]["limits"]) == {"nvidia.com/gpu"}
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    shm = next(v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"])
    assert shm["emptyDir"]["medium"] == "Memory"


def test_agent_and_server_share_image_and_home(docs):
    """Workers run the server's Python (sys.executable) and checkpoint under
    the server's $TIDAL_HOME/checkpoints: the same image and home everywhere."""
    dep, server, _ = server_parts(docs)
    ds, agent = agent_parts(docs)
    tidal_images = {c["image"] for w in (dep, ds) for c in containers(pod_spec(w))}
    assert tidal_images == {agent["image"]}, "every Tidal container runs one image"
    assert env_of(server)["TIDAL_HOME"]["value"] == env_of(agent)["TIDAL_HOME"]["value"]
    home = env_of(agent)["TIDAL_HOME"]["value"]
    assert {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}[home] == "home"
    dockerfile = DOCKERFILE.read_text()
    assert f"TIDAL_HOME={home}" in dockerfile
    uid = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert uid, "the Dockerfile's USER must be numeric (runAsNonRoot)"
    for w in (dep, ds):
        assert pod_spec(w)["securityContext"]["runAsUser"] == int(uid.group(1))


def test_agent_has_an_exec_liveness_probe(docs):
    _, agent = agent_parts(docs)
    probe = agent["livenessProbe"]
    assert probe["exec"]["command"][:2] == ["python", "-c"]
    # lenient: a restart stops every job process on the node
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 60


# -- references, images, privileges, RBAC ----------------------------------------------------


def _references(spec: dict) -> Iterator[tuple[str, str, str | None]]:
    """(kind, name, key) of every Secret, ConfigMap and claim a pod names."""
    for c in containers(spec):
        for e in c.get("env", []):
            src = e.get("valueFrom", {})
            for kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if field in src:
                    yield kind, src[field]["name"], src[field]["key"]
        for e in c.get("envFrom", []):
            for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                if field in e:
                    yield kind, e[field]["name"], None
    for v in spec.get("volumes", []):
        if "secret" in v:
            for item in v["secret"].get("items", [{"key": None}]):
                yield "Secret", v["secret"]["secretName"], item["key"]
        if "configMap" in v:
            yield "ConfigMap", v["configMap"]["name"], None
        if "persistentVolumeClaim" in v:
            yield "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"], None
        for src in v.get("projected", {}).get("sources", []):
            if "configMap" in src:
                for item in src["configMap"].get("items", [{"key": None}]):
                    yield "ConfigMap", src["configMap"]["name"], item["key"]
            if "secret" in src:
                yield "Secret", src["secret"]["name"], None


def test_every_referenced_secret_configmap_and_claim_is_rendered(docs):
    have = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    missing = []
    for w in (d for d in docs if d["kind"] in WORKLOADS):
        spec = pod_spec(w)
        sa = spec.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in have:
            missing.append(f"{w['metadata']['name']}: ServiceAccount {sa}")
        for kind, name, key in _references(spec):
            if kind == "ConfigMap" and name in BUILTIN_CONFIGMAPS:
                continue
            obj = have.get((kind, name))
            if obj is None:
                missing.append(f"{w['metadata']['name']}: {kind} {name}")
            elif key is not None and key not in (obj.get("data") or {}):
                missing.append(f"{w['metadata']['name']}: {kind} {name} has no key {key}")
    assert not missing, "\n".join(missing)


def test_images_are_pinned(docs):
    for w in (d for d in docs if d["kind"] in WORKLOADS):
        for c in containers(pod_spec(w)):
            image = c["image"]
            if "@sha256:" in image:
                continue
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert tag and tag != "latest", f"{w['metadata']['name']}/{c['name']}: {image} is not pinned"


def test_nothing_runs_privileged(docs):
    """No privileged container, no added capability, no privilege
    escalation, all non-root; the one documented exception is the agents'
    host network (agent.yaml, docs/deploy.md)."""
    for w in (d for d in docs if d["kind"] in WORKLOADS):
        spec, name = pod_spec(w), w["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert not spec.get("hostPID") and not spec.get("hostIPC"), name
        if spec.get("hostNetwork"):
            assert name == "tidal-agent", f"{name} uses the host network"
        assert not any("hostPath" in v for v in spec.get("volumes", [])), name
        assert spec.get("automountServiceAccountToken") is False, name
        for c in containers(spec):
            sc = c.get("securityContext", {})
            assert not sc.get("privileged"), f"{name}/{c['name']}"
            assert sc.get("allowPrivilegeEscalation") is False, f"{name}/{c['name']}"
            assert sc.get("readOnlyRootFilesystem") is True, f"{name}/{c['name']}"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}/{c['name']}"
            assert not sc.get("capabilities", {}).get("add"), f"{name}/{c['name']}"
            assert sc.get("runAsUser", 1) != 0, f"{name}/{c['name']}"


def test_rbac_grants_only_what_the_switch_label_needs(docs):
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    for sa in (d for d in docs if d["kind"] == "ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False
    ds, agent = agent_parts(docs)
    init = {c["name"] for c in pod_spec(ds).get("initContainers", [])}
    if "node-labels" not in init:
        assert not roles and not bindings
        return
    (role,) = roles
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    (binding,) = bindings
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tidal-agent", "namespace": "tidal"}]
    # the token is mounted into the init container only
    token_vols = {v["name"] for v in pod_spec(ds)["volumes"] if "projected" in v}
    for c in containers(pod_spec(ds)):
        mounted = {m["name"] for m in c.get("volumeMounts", [])} & token_vols
        assert mounted == (token_vols if c["name"] == "node-labels" else set()), c["name"]


def test_network_policies_select_the_pods_and_port(docs):
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    if not policies:
        pytest.skip("no NetworkPolicy in this variant")
    dep, c, _ = server_parts(docs)
    ds, _ = agent_parts(docs)
    workloads = {w["metadata"]["name"]: w for w in docs if w["kind"] in WORKLOADS}
    for name, pol in policies.items():
        labels = workloads[name]["spec"]["template"]["metadata"]["labels"]
        assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items(), name
    if "tidal-server" in policies:
        ports = [p["port"] for rule in policies["tidal-server"]["spec"]["ingress"] for p in rule["ports"]]
        assert ports == [int(arg_after(c["args"], "--port"))]
        peers = [p for rule in policies["tidal-server"]["spec"]["ingress"] for p in rule["from"]]
        agent_labels = ds["spec"]["template"]["metadata"]["labels"]
        assert any("ipBlock" in p for p in peers), "hostNetwork agents come from the nodes' addresses"
        assert any(p.get("podSelector", {}).get("matchLabels", {}).items() <= agent_labels.items()
                   for p in peers if "podSelector" in p)


def test_bundled_database_url_points_at_the_bundled_postgres(docs):
    if not any(d["kind"] == "StatefulSet" for d in docs):
        pytest.skip("no bundled database in this variant")
    import base64

    sts = one(docs, "StatefulSet", "tidal-postgres")
    svc = one(docs, "Service", "tidal-postgres")
    db = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("tidal-db-"))
    data = {k: base64.b64decode(v).decode() for k, v in db["data"].items()}
    url = urlparse(data["url"])
    assert url.scheme == "postgresql+psycopg"
    assert url.hostname == svc["metadata"]["name"]
    assert url.port == svc["spec"]["ports"][0]["port"]
    assert url.password == data["password"]
    pg = container(pod_spec(sts), "postgres")
    assert url.username == env_of(pg)["POSTGRES_USER"]["value"]
    assert url.path.lstrip("/") == env_of(pg)["POSTGRES_DB"]["value"]
    assert container_port(pg, svc["spec"]["ports"][0]["targetPort"]) == url.port
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_committed_secrets_are_placeholders(docs):
    import base64

    for d in (d for d in docs if d["kind"] == "Secret"):
        for key, value in d["data"].items():
            text = base64.b64decode(value).decode()
            assert "REPLACE-ME" in text, f"{d['metadata']['name']}/{key} is not an obvious placeholder"


# -- the embedded scripts --------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(variant_dirs) -> list[dict]:
    if KUBECTL is None:
        pytest.skip("kubectl not found: the manifests cannot be rendered")
    return [dict(d) for d in _render_dir(variant_dirs["external-postgres+switch-label+network-policy"])]


def test_embedded_python_compiles(plain):
    for w in (d for d in plain if d["kind"] in WORKLOADS):
        for c in containers(pod_spec(w)):
            cmds = [c.get("command", []), c.get("livenessProbe", {}).get("exec", {}).get("command", [])]
            for cmd in cmds:
                if cmd[:2] == ["python", "-c"]:
                    compile(cmd[2], f"{w['metadata']['name']}/{c['name']}", "exec")


def _install_script(plain: list[dict], tmp: Path) -> tuple[list[str], dict[str, str], Path, Path]:
    dep, _, _ = server_parts(plain)
    init = container(pod_spec(dep), "install-credentials")
    creds, home = tmp / "credentials", tmp / "home"
    creds.mkdir()
    home.mkdir()
    env = {**os.environ, "CREDENTIALS_DIR": str(creds), "TIDAL_HOME": str(home)}
    return init["command"] + init["args"], env, creds, home


@pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("tidal") is None,
                    reason="make-secrets.sh needs openssl and tidal on PATH")
def test_credentials_check_refuses_placeholders_and_installs_real_secrets(plain, tmp_path):
    argv, env, creds, home = _install_script(plain, tmp_path)
    placeholders = KDIR / "overlays" / "external-postgres" / "secrets"
    for f in ("server.secret", "agent.token"):
        shutil.copy(placeholders / f, creds / f)
    env["TIDAL_ADMIN_TOKEN"] = (placeholders / "admin.token").read_text()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "placeholder" in out.stderr
    assert not (home / "server.secret").exists()

    # the documented way: make-secrets.sh on a copy of the overlay
    overlay = tmp_path / "overlay"
    shutil.copytree(placeholders.parent, overlay)
    made = subprocess.run(["sh", str(KDIR / "make-secrets.sh"), str(overlay)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DB_URL": "postgresql+psycopg://u:p@db:5432/tidal"})
    assert made.returncode == 0, made.stderr
    secrets = overlay / "secrets"
    for f in secrets.iterdir():
        text = f.read_text()
        assert "REPLACE" not in text and text == text.strip(), f"{f.name}: placeholder or whitespace"
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name
    secret = (secrets / "server.secret").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    assert (secrets / "agent.token").read_text() == Credentials(bytes.fromhex(secret)).agent_token()
    assert (secrets / "db-url").read_text() == "postgresql+psycopg://u:p@db:5432/tidal"

    for f in ("server.secret", "agent.token"):
        shutil.copy(secrets / f, creds / f)
    env["TIDAL_ADMIN_TOKEN"] = (secrets / "admin.token").read_text()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    installed = home / "server.secret"
    assert installed.read_text().strip() == secret
    assert stat.S_IMODE(installed.stat().st_mode) == 0o600

    # a join token from another secret is refused (agents would get 403 forever)
    (creds / "agent.token").write_text(Credentials(bytes(32)).agent_token())
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "agent.token" in out.stderr


def test_liveness_probe_finds_a_running_agent_and_not_a_stopped_one(plain, tmp_path):
    _, agent = agent_parts(plain)
    code = agent["livenessProbe"]["exec"]["command"][2]
    # a unique word for "agent", so that real agents on this machine do not count
    word = f"agent-under-test-{os.getpid()}"
    assert code.count('b"agent"') == 1
    code = code.replace('b"agent"', f'b"{word}"')
    fake = tmp_path / "tidal"
    fake.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(fake), word])
    try:
        time.sleep(0.2)
        assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode != 0
    finally:
        proc.kill()
        proc.wait()
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode != 0


def test_switch_wrapper_appends_the_label_only_when_the_node_has_one(plain, tmp_path):
    _, agent = agent_parts(plain)
    cmd = agent["command"]
    assert cmd[:2] == ["/usr/bin/tini", "--"] and cmd[2:4] == ["/bin/sh", "-c"]
    script = cmd[4].replace("/run/tidal/node-labels", str(tmp_path))
    argv = ["sh", "-c", script, cmd[5], "printf", "%s\\n", *agent["args"]]

    def run() -> list[str]:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    assert run() == agent["args"]  # no file: no label
    (tmp_path / "switch").write_text("")
    assert run() == agent["args"]
    (tmp_path / "switch").write_text("rack3")
    assert run() == [*agent["args"], "--label", "switch=rack3"]


def test_dockerfile_pins_torch_and_installs_what_the_agent_needs():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    assert '"torch==${TORCH_VERSION}"' in text
    assert "nvidia-ml-py" in text  # the agent counts GPUs with pynvml
    assert "[postgres]" in text
    assert re.search(r'^ENTRYPOINT \["/usr/bin/tini", "--"\]$', text, re.M)
