"""deploy/helm/emsd: rendered by Helm itself (helm-python-sdk), linted, checked against the Kubernetes
schemas (kubernetes-validate), and the fields that matter checked by hand: probes, the socket hostPath,
hugepages, ZooKeeper, and a config that emsd accepts, written by the pod's own start command.

Helm runs in a child process: its Go runtime stays out of the test process, which runs asyncio tests.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from emsd.config import load_config

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (scripts/setup-deploy-checks.sh)")
if importlib.util.find_spec("helm_python") is None:
    pytest.skip("helm-python-sdk is not installed (scripts/setup-deploy-checks.sh installs it into .venv)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "emsd"
CLUSTER_VALUES: dict[str, Any] = yaml.safe_load((CHART / "ci" / "cluster-values.yaml").read_text())
Doc = dict[str, Any]
HELM = """
import json, sys
import helm_python as helm
op, chart, values = json.load(sys.stdin)
try:
    if op == "render":
        out = helm.Chart.load(chart).render(values, name="emsd", namespace="kv", is_install=True)
    else:
        out = helm.lint(chart, values, strict=True)
except helm.HelmError as exc:
    sys.exit(f"helm: {exc}")
json.dump(out, sys.stdout)
"""


class HelmFailed(Exception):
    pass


def helm(op: str, values: dict[str, Any] | None) -> Any:
    return json.loads(_helm(json.dumps([op, str(CHART), values or {}], sort_keys=True)))


@functools.cache
def _helm(request: str) -> str:
    run = subprocess.run([sys.executable, "-c", HELM], input=request, capture_output=True, text=True,
                         timeout=120)
    if run.returncode != 0:
        raise HelmFailed(run.stderr.strip())
    return run.stdout


def render(values: dict[str, Any] | None = None) -> list[Doc]:
    out: dict[str, str] = helm("render", values)
    return [d for name, text in sorted(out.items()) if name.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def only(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def container(docs: list[Doc], kind: str, name: str) -> Doc:
    spec = only(docs, kind)["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def config_toml(docs: list[Doc]) -> str:
    return str(only(docs, "ConfigMap")["data"]["emsd.toml"])


@pytest.fixture(params=["default", "cluster"])
def case(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(CLUSTER_VALUES if request.param == "cluster" else None)


@pytest.mark.parametrize("values", [None, CLUSTER_VALUES], ids=["default", "cluster"])
def test_helm_lint(values: dict[str, Any] | None) -> None:
    report = helm("lint", values)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_kinds() -> None:
    kinds = sorted((d["apiVersion"], d["kind"]) for d in render())
    assert kinds == [("apps/v1", "DaemonSet"), ("v1", "ConfigMap"), ("v1", "Service")]
    kinds = sorted((d["apiVersion"], d["kind"]) for d in render(CLUSTER_VALUES))
    assert kinds == [("apps/v1", "DaemonSet"), ("apps/v1", "StatefulSet"),
                     ("monitoring.coreos.com/v1", "ServiceMonitor"), ("v1", "ConfigMap"),
                     ("v1", "Secret"), ("v1", "Service"), ("v1", "Service"), ("v1", "Service")]


@pytest.mark.parametrize("kube", ["1.25.0", "1.37.0"])
def test_kubernetes_schemas(case: tuple[str, list[Doc]], kube: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                             "(scripts/setup-deploy-checks.sh installs it into .venv)")
    for doc in case[1]:
        if doc["kind"] != "ServiceMonitor":  # a CRD: no schema offline; checked below
            kv.validate(doc, kube, strict=True)
    broken = only(case[1], "DaemonSet")
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kv.utils.ValidationError):  # the check can fail
        kv.validate(broken, kube, strict=True)


def test_probes_annotations_and_ports(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    emsd = container(docs, "DaemonSet", "emsd")
    config = tomllib.loads(config_toml(docs))
    port = int(config["metrics"]["listen"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in emsd["ports"]}
    assert ports["metrics"] == port
    for probe, path in (("startupProbe", "/readyz"), ("livenessProbe", "/healthz"),
                        ("readinessProbe", "/readyz")):
        assert emsd[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
    annotations = only(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    if "cluster" in config:
        assert ports["peer"] == int(config["cluster"]["peer_listen"].rsplit(":", 1)[1])


def test_socket_hostpath_is_the_config_socket_dir(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    pod = only(docs, "DaemonSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "hostPath" in v]
    assert volume["hostPath"] == {"path": "/dev/shm/ems", "type": "DirectoryOrCreate"}
    socket_dir = tomllib.loads(config_toml(docs))["node"]["socket_dir"]
    for c in [*pod["initContainers"], *pod["containers"]]:
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["mountPath"] == socket_dir == "/dev/shm/ems"
    init = pod["initContainers"][0]
    assert init["command"][-1] == socket_dir and init["securityContext"]["runAsUser"] == 0
    assert container(docs, "DaemonSet", "emsd")["securityContext"]["runAsNonRoot"] is True


def test_a_keeper_container_holds_the_pool_at_the_daemons_keeper_path(case: tuple[str, list[Doc]]) -> None:
    """emsd restarts in its container; the keeper beside it keeps the pool (warm restart)."""
    _, docs = case
    keeper = container(docs, "DaemonSet", "keeper")
    config = tomllib.loads(config_toml(docs))
    state_dir = config["pool"].get("state_dir") or config["node"]["socket_dir"]
    assert keeper["args"] == [f'exec python -m emsd.pool.keeper "{state_dir}/emsd-$NODE_ID.keeper"']
    assert config["node"]["id"] == "@NODE_ID@"  # the emsd container fills in the same node name
    assert keeper["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    emsd = container(docs, "DaemonSet", "emsd")
    assert keeper["securityContext"]["runAsUser"] == emsd["securityContext"]["runAsUser"]


def test_hugepages() -> None:
    default = container(render(), "DaemonSet", "emsd")["resources"]
    assert "hugepages-2Mi" not in default["requests"] and "hugepages-2Mi" not in default["limits"]
    assert tomllib.loads(config_toml(render()))["pool"]["hugepages"] == "off"
    docs = render(CLUSTER_VALUES)
    resources = container(docs, "DaemonSet", "emsd")["resources"]
    assert resources["requests"]["hugepages-2Mi"] == resources["limits"]["hugepages-2Mi"] == "4Gi"
    pool = tomllib.loads(config_toml(docs))["pool"]
    assert pool == {**pool, "size": "4GiB", "hugepages": "on"}


def emsd_stub(bin_dir: Path) -> None:
    """An ``emsd`` on PATH that loads its --config with emsd.config and prints what it read."""
    bin_dir.mkdir()
    stub = bin_dir / "emsd"
    code = ("import sys; from emsd.config import load_config; c = load_config(sys.argv[2]); "
            "print(c.node.id, c.cluster.advertised, c.cluster.zookeeper, c.cluster.secret_file)")
    stub.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(code)} \"$@\"\n")
    stub.chmod(0o755)


def test_the_pods_command_writes_a_config_emsd_accepts(case: tuple[str, list[Doc]], tmp_path: Path) -> None:
    """Run the container's own command, with the downward-API values filled in and a stub emsd."""
    name, docs = case
    emsd = container(docs, "DaemonSet", "emsd")
    env = {e["name"]: e for e in emsd["env"]}
    assert env["NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["ADVERTISE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    mounts = {m["name"]: m["mountPath"] for m in emsd["volumeMounts"]}
    assert env["EMSD_TEMPLATE"]["value"] == mounts["config"] + "/emsd.toml"
    assert Path(env["EMSD_CONFIG"]["value"]).parent == Path(mounts["tmp"])
    (tmp_path / "emsd.toml.in").write_text(config_toml(docs))
    emsd_stub(tmp_path / "bin")
    run = subprocess.run(
        [*emsd["command"], *emsd["args"]], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "NODE_ID": "gpu-node-7.example",
             "ADVERTISE_IP": "10.1.2.3", "EMSD_TEMPLATE": str(tmp_path / "emsd.toml.in"),
             "EMSD_CONFIG": str(tmp_path / "emsd.toml")})
    assert run.returncode == 0, run.stderr
    config = load_config(tmp_path / "emsd.toml")
    assert config.node.id == "gpu-node-7.example"
    if name == "default":
        assert not config.cluster.enabled
        return
    assert run.stdout.split() == ["gpu-node-7.example", "10.1.2.3:11000", "emsd-zookeeper:2181",
                                  "/etc/emsd/secret/cluster-secret"]
    (secret,) = [v for v in only(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert f"{mounts[secret['name']]}/{secret['secret']['items'][0]['path']}" == config.cluster.secret_file
    assert config.cluster.replicas == 2 and config.cluster.name == "prod"


def test_cluster_secret() -> None:
    docs = render(CLUSTER_VALUES)
    data = only(docs, "Secret")["data"]["cluster-secret"]
    assert base64.b64decode(data).decode() == CLUSTER_VALUES["cluster"]["secret"]
    pod = only(docs, "DaemonSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == only(docs, "Secret")["metadata"]["name"]
    existing = {**CLUSTER_VALUES, "cluster": {**CLUSTER_VALUES["cluster"], "secret": "",
                                              "existingSecret": "mine", "existingSecretKey": "k"}}
    docs = render(existing)
    assert not [d for d in docs if d["kind"] == "Secret"]
    (volume,) = [v for v in only(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "mine" and volume["secret"]["items"][0]["key"] == "k"


def with_cluster(**cluster: Any) -> dict[str, Any]:
    return {**CLUSTER_VALUES, "cluster": {**CLUSTER_VALUES["cluster"], **cluster}}


@pytest.mark.parametrize(("values", "message"), [
    (lambda: with_cluster(secret=""), "cluster.secret"),
    (lambda: with_cluster(secret="too-short"), "at least 16"),
    (lambda: {**with_cluster(), "zookeeper": {"enabled": False}}, "needs ZooKeeper"),
    (lambda: {"pool": {"size": "1.5GiB"}}, "pool.size"),
])
def test_bad_values_fail_to_render(values: Callable[[], dict[str, Any]], message: str) -> None:
    with pytest.raises(HelmFailed, match=message):
        render(values())


def test_network_modes() -> None:
    host = container(render({**CLUSTER_VALUES, "hostNetwork": True}), "DaemonSet", "emsd")
    pod = only(render({**CLUSTER_VALUES, "hostNetwork": True}), "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {e["name"]: e for e in host["env"]}["ADVERTISE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] \
        == "status.podIP"
    hp = container(render({**CLUSTER_VALUES, "peerHostPort": True}), "DaemonSet", "emsd")
    assert {e["name"]: e for e in hp["env"]}["ADVERTISE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] \
        == "status.hostIP"
    assert {p["name"]: p for p in hp["ports"]}["peer"]["hostPort"] == 11000


def test_zookeeper(tmp_path: Path) -> None:
    docs = render(CLUSTER_VALUES)
    sts = only(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 3
    zk = container(docs, "StatefulSet", "zookeeper")
    assert zk["image"] == "zookeeper:3.8"
    env = {e["name"]: e.get("value") for e in zk["env"]}
    name, headless = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert env["ZOO_SERVERS"].split() == [
        f"server.{i + 1}={name}-{i}.{headless}.kv.svc.cluster.local:2888:3888;2181" for i in range(3)]
    assert env["ZOO_STANDALONE_ENABLED"] == "false"
    assert only(docs, "Service", headless)["spec"]["clusterIP"] == "None"
    client = only(docs, "Service", name)
    assert client["spec"]["ports"][0]["port"] == 2181
    assert tomllib.loads(config_toml(docs))["cluster"]["zookeeper"] == f"{name}:2181"
    zk_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert client["spec"]["selector"].items() <= zk_labels.items()
    daemon_selector = only(docs, "DaemonSet")["spec"]["selector"]["matchLabels"]
    assert not daemon_selector.items() <= zk_labels.items(), "the DaemonSet must not select ZooKeeper pods"
    # myid = ordinal + 1, from the pod's own command with a stand-in for the image's entrypoint.
    entry = tmp_path / "entrypoint.sh"
    entry.write_text('#!/bin/sh\necho "$ZOO_MY_ID $*"\n')
    entry.chmod(0o755)
    script = zk["args"][0].replace("/docker-entrypoint.sh", str(entry))
    run = subprocess.run([*zk["command"], script], env={"HOSTNAME": f"{name}-2", "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, timeout=30)
    assert run.stdout.split() == ["3", "zkServer.sh", "start-foreground"], run.stderr
    five = only(render({**CLUSTER_VALUES, "zookeeper": {"enabled": True, "replicas": 5}}), "StatefulSet")
    assert five["spec"]["replicas"] == 5


def test_service_monitor_selects_the_metrics_service() -> None:
    docs = render(CLUSTER_VALUES)
    monitor = only(docs, "ServiceMonitor")
    service = only(docs, "Service", "emsd")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert service["spec"]["selector"].items() <= \
        only(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"].items()
