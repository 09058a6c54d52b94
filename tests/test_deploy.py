"""The deployment files against the code: the image's entry point, the compose file, the Kubernetes manifests.

The manifests are validated against Kubernetes' own schemas (kubernetes-validate,
which bundles them) and their references checked: every selector matches the
labels of the pods it must find, every Service targets a port a container
names, every ConfigMap and Secret named exists (the Secret from the example
overlay's generator), every probe's path is answered by the real application
(the web's WSGI app, the gateway's ASGI app), every role given is one the entry
point knows, every setting is documented. The overlay is applied here as
kustomize would for what it uses (namespace, images, replicas, a Secret from an
env file, a strategic merge of a ConfigMap's data).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.test_docs import variables_documented

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
ENTRYPOINT = ROOT / "scripts" / "container-entrypoint.sh"
# Where the Containerfile puts the entry point (its WORKDIR and ENTRYPOINT).
IMAGE_ENTRYPOINT = "/opt/llmgw/scripts/container-entrypoint.sh"
KUBERNETES_VERSION = "1.31"


def entrypoint_roles() -> tuple[set[str], set[str]]:
    """The roles the entry point runs, and those its `health` answers for, read from its case arms."""
    text = ENTRYPOINT.read_text()
    top, _, rest = text.partition("health)")
    roles = set(re.findall(r"^([a-z]+)\) ", top, re.M)) | {"health"}
    health = set(re.findall(r"^\s+([a-z]+)\) ", rest.partition("esac")[0], re.M))
    return roles, health


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomize(directory: Path) -> list[dict]:
    """The objects a kustomization makes, for the fields this project's kustomizations use."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for res in k.get("resources", []):
        path = directory / res
        assert path.exists(), f"{directory.name}: resource {res} does not exist"
        objects += kustomize(path) if path.is_dir() else load(path)
    for gen in k.get("secretGenerator", []):
        data = {}
        for env in gen.get("envs", []):
            # The example overlay ships its env file as *.example: the keys are what matters here.
            path = directory / env if (directory / env).exists() else directory / f"{env}.example"
            lines = [line for line in path.read_text().splitlines() if "=" in line and not line.startswith("#")]
            data |= {line.split("=", 1)[0]: "" for line in lines}
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]}, "stringData": data})
    for patch in k.get("patches", []):
        p = yaml.safe_load((directory / patch["path"]).read_text())
        target = find(objects, p["kind"], p["metadata"]["name"])
        assert p["kind"] == "ConfigMap", "only ConfigMap patches are applied here"
        target["data"] |= p["data"]
    for image in k.get("images", []):
        for c in containers(objects):
            if c["image"] == image["name"]:
                c["image"] = f"{image['newName']}:{image['newTag']}"
    for r in k.get("replicas", []):
        find(objects, "Deployment", r["name"])["spec"]["replicas"] = r["count"]
    for label in k.get("labels", []):
        for o in objects:
            o["metadata"].setdefault("labels", {}).update(label["pairs"])
    if "namespace" in k:
        for o in objects:
            if o["kind"] != "Namespace":
                o["metadata"]["namespace"] = k["namespace"]
    return objects


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def pod_specs(objects: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of each Deployment and Job."""
    return [(o, o["spec"]["template"]["spec"]) for o in objects if o["kind"] in ("Deployment", "Job")]


def containers(objects: list[dict]) -> list[dict]:
    return [c for _, spec in pod_specs(objects) for c in spec["containers"]]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return kustomize(KUBE / "base")


@pytest.fixture(scope="module")
def example() -> list[dict]:
    return kustomize(KUBE / "overlays" / "example")


def test_every_object_is_valid_against_the_kubernetes_schemas(example):
    kinds = set()
    for o in example:
        if o["kind"] == "ServiceMonitor":
            continue  # Prometheus operator's resource: no schema in Kubernetes'; its references are checked below
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        kinds.add(o["kind"])
    assert kinds == {"Namespace", "ConfigMap", "Secret", "Job", "Deployment", "Service", "PodDisruptionBudget"}
    # The validator does catch a mistake of this kind.
    broken = json.loads(json.dumps(find(example, "Deployment", "llmgw-web")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = ["http"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_roles_and_their_replicas(base, example):
    roles, health = entrypoint_roles()
    assert roles == {"web", "gateway", "worker", "beat", "migrate", "manage", "health"}
    assert health == {"web", "gateway", "worker"}
    by_role = {}
    for workload, spec in pod_specs(base):
        (c,) = spec["containers"]
        assert c["args"][0] in roles
        by_role[c["args"][0]] = workload
        # No state in the pods: the only writable place is beat's scratch schedule.
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["runAsNonRoot"] is True
        writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
        assert writable == (["/var/lib/llmgw/celery"] if c["args"] == ["beat"] else [])
    assert {r: w["kind"] for r, w in by_role.items()} == {
        "web": "Deployment", "gateway": "Deployment", "worker": "Deployment", "beat": "Deployment", "migrate": "Job",
    }  # fmt: skip
    assert by_role["beat"]["spec"]["replicas"] == 1
    assert by_role["beat"]["spec"]["strategy"] == {"type": "Recreate"}
    assert find(example, "Deployment", "llmgw-web")["spec"]["replicas"] == 3
    assert {c["image"] for c in containers(example)} == {"registry.example.com/llmgw:0.1.0"}
    assert {o["metadata"].get("namespace") for o in example if o["kind"] != "Namespace"} == {"llmgw"}


def test_selectors_match_the_pods_and_services_target_named_ports(example):
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in example if o["kind"] == "Deployment"}
    for name, template in pods.items():
        selector = find(example, "Deployment", name)["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
    services = [o for o in example if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"llmgw-web", "llmgw-gateway"}
    for svc in services:
        matched = [t for t in pods.values() if svc["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert len(matched) == 1, svc["metadata"]["name"]
        names = {p["name"] for c in matched[0]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
    for pdb in (o for o in example if o["kind"] == "PodDisruptionBudget"):
        wanted = pdb["spec"]["selector"]["matchLabels"].items()
        assert any(wanted <= t["metadata"]["labels"].items() for t in pods.values())
    monitor = find(example, "ServiceMonitor", "llmgw")
    sel = monitor["spec"]["selector"]
    (expr,) = sel["matchExpressions"]
    watched = [
        s for s in services
        if sel["matchLabels"].items() <= s["metadata"]["labels"].items()
        and s["metadata"]["labels"][expr["key"]] in expr["values"]
    ]  # fmt: skip
    assert {s["metadata"]["name"] for s in watched} == {"llmgw-web", "llmgw-gateway"}
    for endpoint in monitor["spec"]["endpoints"]:
        assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in watched)
        ref = endpoint["bearerTokenSecret"]
        assert ref["key"] in find(example, "Secret", ref["name"])["stringData"]


def test_configmaps_secrets_and_settings_exist(example):
    config = find(example, "ConfigMap", "llmgw-config")["data"]
    secret = find(example, "Secret", "llmgw-secrets")["stringData"]
    documented = variables_documented()
    assert set(config) - documented == set(), "every setting is in docs/configuration.md"
    for _, spec in pod_specs(example):
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            for ref in c["envFrom"]:
                find(example, "ConfigMap", ref["configMapRef"]["name"])
            assert {e["name"] for e in c.get("env", [])} <= documented
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
            for name, value in config.items():
                if name.endswith("_FILE"):
                    directory, key = value.rsplit("/", 1)
                    volume = mounts[directory]["secret"]["secretName"]
                    assert key in find(example, "Secret", volume)["stringData"], name
    assert set(secret) == {"secret-key", "database-url", "redis-url", "broker-url", "join-token", "metrics-token"}


def _wsgi_status(path: str) -> str:
    from llmgw.wsgi import application

    status: list[str] = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "SERVER_NAME": "10.0.0.9", "SERVER_PORT": "8000",
               "HTTP_HOST": "10.0.0.9:8000", "wsgi.input": io.BytesIO(), "wsgi.url_scheme": "http",
               "wsgi.errors": io.StringIO()}  # fmt: skip
    b"".join(application(environ, lambda s, h: status.append(s)))
    return status[0]


def _asgi_status(path: str) -> int:
    from gateway.dataplane.app import DataPlane

    app = DataPlane()
    app.loaded.set()
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m: dict) -> None:
        sent.append(m)

    asyncio.run(app({"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""}, receive, send))
    return sent[0]["status"]


@pytest.mark.django_db(transaction=True)
def test_every_probe_is_answered_by_the_application(example):
    _, health = entrypoint_roles()
    probes = 0
    for _, spec in pod_specs(example):
        for c in spec["containers"]:
            for kind in ("readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                probes += 1
                if "httpGet" in probe:
                    port = next(p["containerPort"] for p in c["ports"] if p["name"] == probe["httpGet"]["port"])
                    path = probe["httpGet"]["path"]
                    if c["args"] == ["web"]:
                        assert port == 8000
                        assert _wsgi_status(path) == "200 OK", path
                    else:
                        assert (c["args"], port) == (["gateway"], 8080)
                        assert _asgi_status(path) == 200, path
                else:
                    cmd = probe["exec"]["command"]
                    assert cmd[0] == IMAGE_ENTRYPOINT
                    assert cmd[1] == "health" and cmd[2] in health and cmd[2] == c["args"][0]
    assert probes == 6  # readiness and liveness of web, gateway and worker
    assert 'ENTRYPOINT ["' + IMAGE_ENTRYPOINT + '"]' in (ROOT / "deploy/image/Containerfile").read_text()


def test_the_compose_file_starts_every_role(tmp_path):
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    _, health = entrypoint_roles()
    commands = sorted(s["command"][0] for s in services.values())
    assert commands == ["beat", "gateway", "gateway", "migrate", "web", "web", "worker", "worker"]
    listen = [s["environment"].get("LLMGW_LISTEN") or s["environment"].get("LLMGW_GATEWAY_LISTEN")
              for s in services.values() if s["command"][0] in ("web", "gateway")]  # fmt: skip
    assert len(set(listen)) == 4, "host networking: each server its own port"
    workers = [s["environment"]["LLMGW_WORKER_NAME"] for s in services.values() if s["command"] == ["worker"]]
    assert len(set(workers)) == 2
    documented = variables_documented()
    for name, s in services.items():
        assert s["network_mode"] == "host"
        assert set(s["environment"]) <= documented, name
        if s["command"][0] != "migrate":
            assert s["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
        if "healthcheck" in s:
            cmd = s["healthcheck"]["test"]
            assert cmd[1:3] == [IMAGE_ENTRYPOINT, "health"] and cmd[3] == s["command"][0] and cmd[3] in health


def run_entrypoint(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The image's entry point, run from the checkout with this interpreter."""
    keep = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG")}
    return subprocess.run(
        [str(ENTRYPOINT), *args], env={**keep, "PYTHON": sys.executable, **env}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_secrets_come_from_files_and_a_missing_one_is_named(tmp_path):
    secret = tmp_path / "secret_key"
    secret.write_text("s3cret-from-a-file\n")
    old = tmp_path / "fallbacks"
    old.write_text("retired-1,retired-2\n")
    code = "from django.conf import settings; print(settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS, settings.DEBUG)"
    r = run_entrypoint(
        "manage", "shell", "--no-imports", "-c", code, SECRET_KEY_FILE=str(secret), SECRET_KEY_FALLBACKS_FILE=str(old),
        DJANGO_SETTINGS_MODULE="llmgw.settings",
    )  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "s3cret-from-a-file ['retired-1', 'retired-2'] False\n"), r.stderr
    r = run_entrypoint("web", SECRET_KEY_FILE=str(tmp_path / "absent"))
    assert r.returncode == 2
    assert f"SECRET_KEY_FILE names {tmp_path / 'absent'}, which cannot be read" in r.stderr
    r = run_entrypoint("serve")
    assert r.returncode == 2 and "unknown role 'serve'" in r.stderr
