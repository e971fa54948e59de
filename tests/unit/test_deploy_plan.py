"""One deploy plan. docs/how-to/deploy.md's "What runs" table gives each long-running process its
metrics port, and docker-compose.yml, deploy/prometheus (scrape targets, the jobs the alerts
read), the Kubernetes manifests (rendered by `kubectl kustomize`) and the commands in the README
and deploy.md serve and scrape exactly those ports; the manifests run what deploy.md promises."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DOC = ROOT / "docs" / "how-to" / "deploy.md"
KUBERNETES = ROOT / "deploy" / "kubernetes"

# The oncely commands that serve /metrics, by kind, and the setting each reads its port from.
KINDS = {("relay", "run"): "relay", ("consume",): "consumer", ("tasks", "run"): "tasks"}
PORT_SETTING = {
    "relay": "ONCELY_RELAY_METRICS_PORT",
    "consumer": "ONCELY_CONSUMER_METRICS_PORT",
    "tasks": "ONCELY_TASKS_METRICS_PORT",
}
# The Prometheus job that scrapes each kind (alerts.yml's `up{job=...}` and rules.yml read them).
JOBS = {"oncely-relay": "relay", "oncely-consumer": "consumer", "oncely-tasks": "tasks"}


def kind_of(args: list[str]) -> str | None:
    """The kind of process an oncely command line runs (`relay run`, `consume`, `tasks run`)."""
    for start in range(len(args)):
        for words, kind in KINDS.items():
            if tuple(args[start : start + len(words)]) == words:
                return kind
    return None


def port_of(args: list[str], env: dict[str, Any], kind: str) -> int | None:
    """The port given by `--metrics-port N` (or `=N`), else by the kind's ONCELY_ setting."""
    for index, arg in enumerate(args):
        if arg == "--metrics-port":
            return int(args[index + 1])
        if arg.startswith("--metrics-port="):
            return int(arg.partition("=")[2])
    value = env.get(PORT_SETTING[kind])
    return None if value is None else int(value)


def markdown(path: Path) -> list[Token]:
    return MarkdownIt("commonmark").enable("table").parse(path.read_text())


def documented_plan() -> dict[str, int]:
    """deploy.md's first table ("What runs"): the metrics port of each long-running process."""
    tokens = markdown(DEPLOY_DOC)
    start = next(i for i, token in enumerate(tokens) if token.type == "table_open")
    end = next(i for i, token in enumerate(tokens) if token.type == "table_close" and i > start)
    rows: list[list[Token]] = []
    for token in tokens[start:end]:
        if token.type == "tr_open":
            rows.append([])
        elif token.type == "inline":
            rows[-1].append(token)
    header = [cell.content.lower() for cell in rows[0]]
    assert "metrics port" in header, (
        f"deploy.md's first table has no 'Metrics port' column: {header}"
    )
    command, port = header.index("command"), header.index("metrics port")
    plan: dict[str, int] = {}
    for row in rows[1:]:
        code = [
            child.content for child in row[command].children or [] if child.type == "code_inline"
        ]
        kind = kind_of(shlex.split(code[0])) if code else None
        if kind is not None:
            plan[kind] = int(row[port].content)
    assert set(plan) == set(KINDS.values()), (
        f"deploy.md's table gives ports for {sorted(plan)} only"
    )
    return plan


def compose_processes(compose: dict[str, Any]) -> Iterator[tuple[str, str, int | None]]:
    """(service, kind, metrics port) of each oncely process of a compose file."""
    for name, service in compose["services"].items():
        command = service.get("command") or []
        args = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        kind = kind_of(args)
        if kind is not None:
            yield name, kind, port_of(args, service.get("environment") or {}, kind)


def fenced(path: Path, *languages: str) -> Iterator[str]:
    for token in markdown(path):
        if token.type == "fence" and token.info.strip() in languages:
            yield token.content


def image_uid() -> int:
    """The uid the Dockerfile's last USER runs as: a number, or a name its `useradd --uid` made."""
    structure = DockerfileParser(path=str(ROOT / "Dockerfile")).structure
    user = [item["value"] for item in structure if item["instruction"] == "USER"][-1]
    name = user.partition(":")[0]
    if name.isdigit():
        return int(name)
    for item in structure:
        words = shlex.split(item["value"]) if item["instruction"] == "RUN" else []
        for start in (i for i, word in enumerate(words) if word == "useradd"):
            command = words[start:]
            command = command[: command.index("&&")] if "&&" in command else command
            if command[-1] == name and "--uid" in command:
                return int(command[command.index("--uid") + 1])
    raise AssertionError(f"the Dockerfile gives user {name!r} no --uid")


@pytest.fixture(scope="module")
def plan() -> dict[str, int]:
    return documented_plan()


@pytest.fixture(scope="module")
def compose_services() -> dict[str, str]:
    """docker-compose.yml's oncely processes: service name -> kind."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return {name: kind for name, kind, _port in compose_processes(compose)}


def test_the_documented_plan_gives_each_kind_its_own_port(plan: dict[str, int]) -> None:
    # Distinct ports let the three run side by side on one host (the README's quickstart).
    assert len(set(plan.values())) == len(plan), plan


@pytest.mark.parametrize(
    "compose_file",
    [
        pytest.param("docker-compose.yml", id="docker-compose.yml"),
        pytest.param(None, id="deploy.md"),
    ],
)
def test_compose_files_serve_the_planned_ports(
    plan: dict[str, int], compose_file: str | None
) -> None:
    if compose_file is not None:
        composes = [yaml.safe_load((ROOT / compose_file).read_text())]
    else:  # deploy.md's compose examples
        composes = [
            doc for doc in map(yaml.safe_load, fenced(DEPLOY_DOC, "yaml")) if "services" in doc
        ]
        assert composes, "deploy.md shows no compose file"
    processes = [process for compose in composes for process in compose_processes(compose)]
    assert {kind for _name, kind, _port in processes} == set(plan)
    for name, kind, port in processes:
        assert port == plan[kind], (
            f"{compose_file or 'deploy.md'}: {name} serves {port}, not {plan[kind]}"
        )


@pytest.mark.parametrize("doc", ["README.md", "docs/how-to/deploy.md"])
def test_shell_commands_in_the_docs_use_the_planned_ports(plan: dict[str, int], doc: str) -> None:
    for block in fenced(ROOT / doc, "sh", "shell", "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            args = shlex.split(line, comments=True)
            if not any(arg.startswith("--metrics-port") for arg in args):
                continue
            kind = kind_of(args)
            assert kind is not None, f"{doc}: which process serves --metrics-port in {line!r}?"
            assert port_of(args, {}, kind) == plan[kind], f"{doc}: {line!r} is not on {plan[kind]}"


def test_prometheus_scrapes_every_compose_process_on_its_port(
    plan: dict[str, int], compose_services: dict[str, str]
) -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    scraped: dict[str, set[str]] = {}
    for job in config["scrape_configs"]:
        kind = JOBS[job["job_name"]]
        for target in (t for static in job["static_configs"] for t in static["targets"]):
            host, _, port = target.rpartition(":")
            assert int(port) == plan[kind], f"prometheus.yml: {target} is not on {plan[kind]}"
            assert compose_services.get(host) == kind, f"prometheus.yml: no {kind} service {host}"
            scraped.setdefault(job["job_name"], set()).add(host)
    assert set(scraped) == set(JOBS)
    for job, kind in JOBS.items():
        expected = {name for name, of in compose_services.items() if of == kind}
        assert scraped[job] == expected, f"prometheus.yml's {job} misses {expected - scraped[job]}"


def test_the_alerts_read_the_scrape_jobs() -> None:
    named: set[str] = set()
    for file in ("alerts.yml", "rules.yml"):
        groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / file).read_text())["groups"]
        for rule in (rule for group in groups for rule in group["rules"]):
            named.update(re.findall(r'\bjob="([^"]+)"', rule["expr"]))
    assert named == set(JOBS), named


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """deploy/kubernetes as `kubectl kustomize` renders it (`make kubernetes-tools` installs it)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not on PATH: `make kubernetes-tools` installs it"
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {KUBERNETES} failed: {out.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def test_kubernetes_pods_serve_probe_and_announce_the_planned_ports(
    plan: dict[str, int], rendered: list[dict[str, Any]]
) -> None:
    deployments = [doc for doc in rendered if doc["kind"] == "Deployment"]
    assert {
        kind_of(c["args"]) for d in deployments for c in d["spec"]["template"]["spec"]["containers"]
    } == set(plan)
    for deployment in deployments:
        name, template = deployment["metadata"]["name"], deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        kind = kind_of(container["args"])
        assert kind is not None, f"{name}: runs no oncely process"
        env = {var["name"]: var.get("value") for var in container.get("env", [])}
        port = port_of(container["args"], env, kind)
        assert port == plan[kind], f"{name} serves {port}, not {plan[kind]}"
        assert container["ports"] == [{"name": "metrics", "containerPort": port}], name
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, (
                f"{name} {probe}"
            )
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/port"] == str(port), f"{name}: scraped on another port"
        assert annotations["prometheus.io/path"] == "/metrics", name
        job = template["metadata"]["labels"]["oncely.dev/job"]
        assert JOBS.get(job) == kind, f"{name}: label oncely.dev/job is {job!r}"


def test_kubernetes_runs_a_consumer_deployment_per_effect_of_the_example(
    rendered: list[dict[str, Any]],
) -> None:
    from examples.payments.app import app

    assert app.effects is not None
    effects: list[str] = []
    for doc in rendered:
        if doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            args = container["args"]
            if kind_of(args) == "consumer":
                effects += [args[i + 1] for i, arg in enumerate(args) if arg == "--effect"]
    assert sorted(effects) == sorted(app.effects.names())
    relay = next(doc for doc in rendered if doc["metadata"]["name"] == "oncely-relay")
    assert relay["spec"]["replicas"] == 2  # the shard leases share the work
    jobs = {
        tuple(doc["spec"]["template"]["spec"]["containers"][0]["args"])
        for doc in rendered
        if doc["kind"] == "Job"
    }
    assert jobs == {("db", "upgrade"), ("topics", "ensure")}


def test_kubernetes_pods_are_hardened_and_budgeted(rendered: list[dict[str, Any]]) -> None:
    budgets = {
        doc["metadata"]["name"]: doc["spec"]
        for doc in rendered
        if doc["kind"] == "PodDisruptionBudget"
    }
    secrets = yaml.safe_load_all((KUBERNETES / "secrets.example.yaml").read_text())
    secret_keys = {doc["metadata"]["name"]: set(doc["stringData"]) for doc in secrets}
    uid = image_uid()
    for doc in rendered:
        if doc["kind"] not in {"Deployment", "Job", "CronJob"}:
            continue
        spec = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
        name, pod = doc["metadata"]["name"], spec["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == uid, f"{name}: not the image's user {uid}"
        assert pod["automountServiceAccountToken"] is False, name
        for container in pod["containers"]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, name
            assert {"requests", "limits"} <= set(container["resources"]), name
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:  # every secret it reads is in the example
                    assert ref["key"] in secret_keys.get(ref["name"], set()), f"{name}: {ref}"
        if doc["kind"] == "Deployment":
            labels = doc["spec"]["selector"]["matchLabels"]
            assert budgets[name]["selector"]["matchLabels"] == labels, f"{name}: no budget"


def test_kubernetes_runs_retention_often_enough_for_its_partitions_ahead(
    rendered: list[dict[str, Any]],
) -> None:
    """The CronJob states its interval (its schedule plus its starting deadline), and the
    partitions created ahead (config.yaml's ONCELY_RETENTION_AHEAD, else the default) outlast
    it with the steps purge.md shows: no step's rows go to the default partition between runs."""
    from oncely import retention
    from oncely.settings import RelaySettings, RetentionSettings
    from oncely.storage import partitions

    (cron,) = [doc for doc in rendered if doc["kind"] == "CronJob"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    minute, hour, *_ = cron["spec"]["schedule"].split()
    assert minute.startswith("*/") and hour == "*"
    period = timedelta(minutes=int(minute.removeprefix("*/")))
    late = timedelta(seconds=cron["spec"]["startingDeadlineSeconds"])
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["args"][:4] == ["retention", "run", "--execute", "--interval"]
    interval = partitions.parse_step(container["args"][4])
    assert interval >= period + late
    assert cron["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"] <= period.total_seconds()
    config = next(doc for doc in rendered if doc["kind"] == "ConfigMap")
    ahead = int(config["data"].get("ONCELY_RETENTION_AHEAD", RetentionSettings().ahead))
    for step in ("15m", "6h", "1d"):
        policy = retention.policy_of(
            RetentionSettings(ahead=ahead), RelaySettings(), interval=interval
        )
        retention.maintenance.check_ahead(partitions.parse_step(step), policy)
    relay = next(doc for doc in rendered if doc["metadata"]["name"] == "oncely-relay")
    (relay_container,) = relay["spec"]["template"]["spec"]["containers"]
    assert container["image"] == relay_container["image"]
    assert container["envFrom"] == relay_container["envFrom"]
    assert container["env"] == relay_container["env"]
