"""deploy/: compose file and Kubernetes manifests pass their official schemas and agree with each other, with the
Dockerfile and with the gateway configurations they mount, which load the way `shapegate check` loads them."""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from deploy.compose_plan import (DEMO_KEYS, interpolate, listen_port, load_compose, local_argv, local_ports,
                                 render_config, seconds, services, start_order)
from deploy.config_watch import _config_arg
from deploy.run_local import levels
from gateway.cli.main import read_config
from gateway.config import GatewayConfig
from gateway.keys.principal import hash_key
from gateway.observe.metrics import POOL_GAUGES
from gateway.ops.lifecycle import CUT_MARGIN_S
from tests.needs import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
MANIFESTS = [*sorted(K8S.glob("*.yaml")), K8S / "secret.yaml.example"]
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
OLDEST_K8S = "1.29"  # the oldest Kubernetes the manifests are written for


def manifests() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def find(kind: str, name: str) -> dict:
    found = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


def container_port(c: dict, port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p.get("name") == port)


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def configmap_config(tmp_path: Path) -> tuple[str, GatewayConfig]:
    """The ConfigMap's only key and its configuration, loaded from a file as the gateway loads it."""
    (key, text), = find("ConfigMap", "shapegate-config")["data"].items()
    path = tmp_path / key
    path.write_text(text)
    return key, read_config(str(path))


def compose_config() -> GatewayConfig:
    return read_config(str(DEPLOY / "config" / "gateway.toml"))


# -- schemas ----------------------------------------------------------------------------------------------


def kubernetes_validate():
    if importlib.util.find_spec("kubernetes_validate") is None:
        skip_or_fail("kubernetes-validate is not installed (pip install -e '.[test]')")
    import kubernetes_validate as kv

    return kv


def test_every_manifest_passes_the_kubernetes_schemas_strictly():
    kv = kubernetes_validate()
    seen = set()
    for name, doc in manifests():
        for version in (OLDEST_K8S, kv.latest_version()):
            kv.validate(doc, version, strict=True)  # strict: an unknown field is an error
        seen.add(doc["kind"])
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "Secret"} <= seen


def test_the_kubernetes_schemas_refuse_a_misspelt_field():
    kv = kubernetes_validate()
    doc = copy.deepcopy(find("Deployment", "gateway"))
    gw = container(doc["spec"]["template"]["spec"], "gateway")
    gw["readinesProbe"] = gw.pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, OLDEST_K8S, strict=True)


def check_compose(path: Path) -> subprocess.CompletedProcess:
    """The compose specification's JSON schema, as the check-jsonschema package ships it (offline)."""
    if importlib.util.find_spec("check_jsonschema") is None:
        skip_or_fail("check-jsonschema is not installed (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], check=False, capture_output=True, text=True, timeout=60)


def test_compose_file_passes_the_compose_spec_schema(tmp_path):
    ok = check_compose(COMPOSE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_perod:"))
    assert check_compose(broken).returncode != 0, "the schema must refuse an unknown service key"


# -- the gateway configurations ---------------------------------------------------------------------------


def test_mounted_configs_load_and_differ_only_in_the_cookie_setting(tmp_path):
    _, k8s = configmap_config(tmp_path)
    local = compose_config()
    assert (local.dashboard.secure_cookie, k8s.dashboard.secure_cookie) == (False, True)  # plain HTTP vs TLS
    a, b = local.model_dump(), k8s.model_dump()
    del a["dashboard"]["secure_cookie"], b["dashboard"]["secure_cookie"]
    assert a == b
    assert local.state.backend == "redis" and local.dashboard.session_secret_env
    # The demo keys the README and run_local print are the ones whose digests the files hold.
    assert {k.id: k.sha256 for k in local.auth.keys} == {i: hash_key(key) for i, key in DEMO_KEYS.items()}
    assert [k.id for k in local.auth.keys if k.admin] == ["demo-admin"]


# -- compose -----------------------------------------------------------------------------------------------


def compose_services() -> dict:
    return services(load_compose(COMPOSE, env={}))  # variables at their defaults, as on a bare machine


def test_compose_gateways_agree_with_their_config():
    svcs = compose_services()
    gateways = [s for s in svcs.values() if s.command[:1] == ["serve"]]
    assert len(gateways) >= 2, "a scale-out stack has two replicas or more"
    assert len({s.published[0][1] for s in gateways}) == len(gateways), "each replica has its own host port"
    for s in gateways:
        cfg = read_config(str(s.host_path(s.option("--config"))))
        assert [target for _, _, target in s.published] == [cfg.server.port] == [s.health_port]
        assert s.health_path == "/healthz"
        assert s.stop_grace_s > cfg.server.shutdown_grace_s + CUT_MARGIN_S
        assert len(s.environment[cfg.dashboard.session_secret_env]) >= 16  # the gateway refuses less
        needed = {urlsplit(b.url).hostname for b in cfg.backends} | {urlsplit(cfg.state.redis_url).hostname}
        assert needed <= set(s.depends_on)
        for b in cfg.backends:
            engine = svcs[urlsplit(b.url).hostname]
            assert listen_port(engine) == urlsplit(b.url).port == engine.health_port
        redis = svcs[urlsplit(cfg.state.redis_url).hostname]
        assert redis.kind == "redis" and listen_port(redis) == urlsplit(cfg.state.redis_url).port


def test_local_mirror_keeps_the_compose_ports_replicas_and_config():
    svcs = compose_services()
    ports = local_ports(svcs, free=False)
    for name, s in svcs.items():
        assert ports[name] == (s.published[0][1] if s.published else listen_port(s))
    assert [ports["gateway-1"], ports["gateway-2"]] == [8080, 8081]
    # Started dependencies first and stopped dependents first, a level at a time, as compose does.
    assert levels(svcs, start_order(svcs)) == [["redis", "vllm-0", "sglang-0", "llama-0"], ["gateway-1", "gateway-2"]]
    argv = local_argv(svcs["gateway-2"], ports["gateway-2"], Path("/tmp/g.toml"))
    assert argv[1:5] == ["-m", "gateway.cli", "serve", "--config"] and option(argv, "--port") == "8081"
    addresses = {name: (listen_port(s), ports[name]) for name, s in svcs.items()}
    text = render_config((DEPLOY / "config" / "gateway.toml").read_text(), addresses, "test:")
    data = tomllib.loads(text)
    assert [b["url"] for b in data["backends"]] == ["http://127.0.0.1:8000", "http://127.0.0.1:30000",
                                                     "http://127.0.0.1:8090"]
    assert (data["state"]["redis_url"], data["state"]["key_prefix"]) == ("redis://127.0.0.1:6379/0", "test:")


@pytest.mark.parametrize(("text", "env", "want"), [
    ("${A:-x}", {}, "x"), ("${A:-x}", {"A": ""}, "x"), ("${A-x}", {"A": ""}, ""), ("${A:-x}", {"A": "y"}, "y"),
    ("$A/${B}", {"A": "1", "B": "2"}, "1/2"), ("$$A", {"A": "1"}, "$A"), ("${A}", {}, ""),
])
def test_compose_variables_interpolate_as_compose_does(text, env, want):
    assert interpolate(text, env) == want


def test_compose_durations():
    assert [seconds("40s"), seconds("1m30s"), seconds("500ms"), seconds(None)] == [40, 90, 0.5, 10]


# -- Kubernetes --------------------------------------------------------------------------------------------


def test_gateway_pods_probe_mount_and_stop_as_their_config_says(tmp_path):
    key, cfg = configmap_config(tmp_path)
    dep = find("Deployment", "gateway")
    pod = dep["spec"]["template"]["spec"]
    gw, reload = container(pod, "gateway"), container(pod, "config-reload")
    config_path = option(gw["args"], "--config")
    # The ConfigMap's key is the file the gateway reads, mounted as a directory (a subPath never updates).
    volume = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == "shapegate-config")
    for c in (gw, reload):
        mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
        assert (mount["mountPath"], key) == os.path.split(config_path) and "subPath" not in mount
    # Probes and scrapes reach the port the config listens on.
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in (gw["readinessProbe"], gw["livenessProbe"]):
        assert container_port(gw, probe["httpGet"]["port"]) == cfg.server.port
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == cfg.server.port
    # preStop keeps serving while endpoints update, then the grace: all inside the pod's termination period.
    sleep = shlex.split(" ".join(gw["lifecycle"]["preStop"]["exec"]["command"]))
    assert sleep[0] == "sleep" and float(sleep[1]) > 0
    assert pod["terminationGracePeriodSeconds"] > float(sleep[1]) + cfg.server.shutdown_grace_s + CUT_MARGIN_S
    # The reload sidecar sees and may signal the gateway's process, and watches the file the gateway reads.
    assert pod["shareProcessNamespace"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert option(reload["command"], "--config") == config_path
    # The session secret comes from the Secret, under the variable the config names.
    (env,) = [e for e in gw["env"] if e["name"] == cfg.dashboard.session_secret_env]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = find("Secret", ref["name"])
    assert len(secret["stringData"][ref["key"]]) < 16, "the example's placeholder must be refused by the gateway"
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"


def test_service_pdb_and_hpa_select_the_gateway_pods(tmp_path):
    _, cfg = configmap_config(tmp_path)
    dep = find("Deployment", "gateway")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(dep["spec"]["selector"]["matchLabels"], labels)
    gw = container(dep["spec"]["template"]["spec"], "gateway")
    svc = find("Service", "gateway")
    assert selects(svc["spec"]["selector"], labels)
    assert [container_port(gw, p["targetPort"]) for p in svc["spec"]["ports"]] == [cfg.server.port]
    pdb = find("PodDisruptionBudget", "gateway")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels) and pdb["spec"]["maxUnavailable"] == 1
    hpa = find("HorizontalPodAutoscaler", "gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "gateway")
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]  # a drain never takes the last pod
    # No other workload's pods fall under the gateway's selectors.
    others = [d for _, d in manifests() if d["kind"] == "Deployment" and d["metadata"]["name"] != "gateway"]
    assert others
    assert not [d for d in others if selects(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]


def test_hpa_scales_on_a_gateway_gauge_the_adapter_rule_serves():
    (metric,) = find("HorizontalPodAutoscaler", "gateway")["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    (rule,) = [r for r in rules if r["name"]["as"] == name]
    series = rule["seriesQuery"].split("{")[0].strip("'\" ")
    gauges = {g[0]: g[2] for g in POOL_GAUGES}
    assert series in gauges, f"{series} is not a gauge of gateway/observe/metrics.py"
    assert series == "shapegate_in_flight" and "backend" in gauges[series]  # summed per pod by the rule
    assert "sum(" in rule["metricsQuery"] and set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_config_addresses_resolve_to_services_of_running_pods(tmp_path):
    _, cfg = configmap_config(tmp_path)
    namespaces = {d["metadata"]["name"] for _, d in manifests() if d["kind"] == "Namespace"}
    for _, d in manifests():
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] in namespaces
    deployments = [d for _, d in manifests() if d["kind"] == "Deployment"]
    for url in (*(b.url for b in cfg.backends), cfg.state.redis_url):
        host, port = urlsplit(url).hostname, urlsplit(url).port
        svc = find("Service", host)
        (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
        (dep,) = [d for d in deployments if selects(svc["spec"]["selector"], pod_labels(d))]
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert container_port(c, sp["targetPort"]) == port


def test_kubernetes_engines_run_the_compose_engines():
    svcs = compose_services()
    for _, d in manifests():
        if d["kind"] == "Deployment" and d["metadata"]["name"] in svcs:
            (c,) = d["spec"]["template"]["spec"]["containers"]
            if c["image"].startswith("shapegate"):
                assert c["args"] == svcs[d["metadata"]["name"]].command


def test_dockerfile_ships_what_compose_and_kubernetes_run():
    lines = [line.split(None, 1) for line in (ROOT / "Dockerfile").read_text().splitlines() if line.strip()
             and not line.startswith("#")]
    instr = {}
    for word, *rest in lines:
        instr.setdefault(word, []).append(rest[0] if rest else "")
    assert json.loads(instr["ENTRYPOINT"][0]) == ["shapegate"]  # compose and k8s give only its arguments
    copies = [c.split() for c in instr["COPY"]]
    (watcher,) = [dest for *src, dest in copies if src == ["deploy/config_watch.py"]]
    pod = find("Deployment", "gateway")["spec"]["template"]["spec"]
    assert container(pod, "config-reload")["command"][:2] == ["python", watcher]
    assert instr["USER"] == ["10001:10001"] and pod["securityContext"]["runAsUser"] == 10001
    # Nothing the image copies is left out of the build context.
    ignored = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    for *sources, _ in copies:
        for src in sources:
            assert not [p for p in ignored if fnmatch.fnmatch(src, p) or src.startswith(p.rstrip("/") + "/")], src


@pytest.mark.parametrize(("argv", "want"), [
    (["/usr/local/bin/python", "/usr/local/bin/shapegate", "serve", "--config", "/etc/s/g.toml"], "/etc/s/g.toml"),
    (["python", "-m", "gateway.cli", "serve", "--port", "1", "--config=/x.toml"], "/x.toml"),
    (["/usr/local/bin/shapegate", "check", "--config", "/etc/s/g.toml"], None),
    (["python", "config_watch.py", "--config", "/etc/s/g.toml"], None),
    (["vim", "serve", "--config", "/etc/s/g.toml"], None),
])
def test_config_watch_recognises_only_gateway_commands(argv, want):
    assert _config_arg(argv) == want


def test_demo_key_digests_are_sha256_of_the_documented_keys():
    text = (DEPLOY / "config" / "gateway.toml").read_text()
    for key in DEMO_KEYS.values():
        assert key in text and hashlib.sha256(key.encode()).hexdigest() in text


# -- one image, a persistent Redis, the license ---------------------------------------------------------------


def test_one_image_name_in_the_dockerfile_compose_and_kubernetes():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    image = f"shapegate:{version}"
    names = {c["image"] for _, d in manifests() if d["kind"] == "Deployment"
             for c in d["spec"]["template"]["spec"]["containers"] if c["image"].startswith("shapegate")}
    compose = load_compose(COMPOSE, env={})
    names |= {s["image"] for s in compose["services"].values() if "build" in s}
    dockerfile = (ROOT / "Dockerfile").read_text()
    names |= set(re.findall(r"\b(shapegate:[\w.-]+)", "\n".join(
        line for line in dockerfile.splitlines() if line.startswith("#"))))
    assert names == {image}
    assert f"docker build -t {image} ." in dockerfile


def test_redis_keeps_an_append_only_file_on_a_volume():
    """The run-time API keys live in Redis: compose and Kubernetes both persist it (AOF on a volume)."""
    redis = load_compose(COMPOSE, env={})["services"]["redis"]
    args = redis["command"]
    assert option(args, "--appendonly") == "yes"
    (volume,) = redis["volumes"]
    name, target = volume.split(":")
    assert target == "/data" and name in load_compose(COMPOSE, env={})["volumes"]
    assert "run-time api keys" in COMPOSE.read_text().lower()
    pod = find("Deployment", "redis")["spec"]["template"]["spec"]
    c = container(pod, "redis")
    assert option(c["args"], "--appendonly") == "yes"
    (mount,) = c["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert mount["mountPath"] == "/data" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert find("Deployment", "redis")["spec"]["strategy"]["type"] == "Recreate"  # one pod holds the volume
    assert "run-time API keys" in (K8S / "redis.yaml").read_text()


def test_the_license_is_the_one_pyproject_names_and_the_image_ships_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] in ("Apache-2.0", {"text": "Apache-2.0"})  # an SPDX expression, or PEP 621's table
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "COPY pyproject.toml README.md LICENSE ./" in (ROOT / "Dockerfile").read_text()
    # run_local's one need beyond the gateway's, as an extra of its own.
    assert any(r.startswith("pyyaml") for r in project["optional-dependencies"]["deploy"])
