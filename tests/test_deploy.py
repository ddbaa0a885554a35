"""deploy/ cannot rot: every `weightsync` command line in the Kubernetes manifests and the systemd
unit parses with the CLI's own parser, every agent config they carry loads with
`load_agent_config` (engine options included), the files the config names are mounted from the
Secrets, the pod's gRPC probes point at the agent's plaintext health port (readiness: the overall
health, liveness: the agent's service), and /metrics binds an address the Prometheus scrape reaches.
Also here: that health port answers a plaintext health check while the agent itself requires TLS
and a token (what a Kubernetes grpc probe does).
"""

from __future__ import annotations

import configparser
import ipaddress
import shlex
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from weightsync.agents.config import AgentConfig, load_agent_config
from weightsync.app.cli import build_parser
from weightsync.transport.rpc import SERVICE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEPLOY = Path(__file__).parent.parent / "deploy"
K8S = DEPLOY / "kubernetes" / "inference-with-agent.yaml"
SECRETS = DEPLOY / "kubernetes" / "secrets.example.yaml"
UNIT = DEPLOY / "systemd" / "weightsync-agent.service"
SYSTEMD_TOML = DEPLOY / "systemd" / "agent.toml"


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _parse_cli(argv: list[str], where: str):
    """The CLI's own argparse: an unknown subcommand or flag fails here (argparse exits 2)."""
    assert PurePosixPath(argv[0]).name == "weightsync", f"{where}: {argv[0]} is not the weightsync command"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse with the CLI's parser (app/cli/)")


def _paths_in(config: AgentConfig) -> list[str]:
    paths = [config.token_file, *config.trusted_keys]
    for tls in (config.tls, config.client_tls):
        if tls is not None:
            paths += [tls.cert, tls.key, tls.ca]
    return [p for p in paths if p]


# --------------------------------------------------------------------------------- Kubernetes


def _k8s():
    docs = _documents(K8S)
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def _agent_container(pod: dict) -> dict:
    containers = [c for c in pod["containers"] if c.get("command", [""])[0] == "weightsync"]
    assert len(containers) == 1, "one weightsync agent sidecar per pod"
    return containers[0]


def test_kubernetes_commands_parse_and_the_agent_config_loads(tmp_path):
    kinds = _k8s()
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    agent = _agent_container(pod)
    argv = agent["command"] + agent.get("args", [])
    args = _parse_cli(argv, K8S.name)
    assert args.command == "agent"

    # --config names the ConfigMap's key, mounted where the command looks
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = mounts[args.config]
    config_map_name = volumes[mount["name"]]["configMap"]["name"]
    config_map = next(c for c in kinds["ConfigMap"] if c["metadata"]["name"] == config_map_name)
    text = config_map["data"][mount["subPath"]]
    path = tmp_path / "agent.toml"
    path.write_text(text)
    config = load_agent_config(path)

    # every file the config names comes from a mounted Secret that secrets.example.yaml defines
    secrets = {s["metadata"]["name"]: s for s in _documents(SECRETS) if s["kind"] == "Secret"}
    for file in _paths_in(config):
        parent, name = str(PurePosixPath(file).parent), PurePosixPath(file).name
        assert parent in mounts, f"{file}: no volume is mounted at {parent}"
        secret_name = volumes[mounts[parent]["name"]]["secret"]["secretName"]
        assert name in secrets[secret_name]["stringData"], f"{file}: Secret {secret_name} has no key {name}"

    # the cache and the engine's snapshot root are on volumes, not the container's own layer
    assert any(config.cache_dir == m or config.cache_dir.startswith(m + "/") for m in mounts)
    assert any(config.engine["root"].startswith(m + "/") for m in mounts)

    # the probes ask the agent's health port, which serves plaintext (grpc probes cannot do TLS):
    # readiness the overall health (a version is served), liveness the service (it takes calls)
    health_port = int(config.health_listen.rsplit(":", 1)[1])
    for probe in ("readinessProbe", "livenessProbe"):
        assert agent[probe]["grpc"]["port"] == health_port
    assert agent["readinessProbe"]["grpc"].get("service", "") == ""
    assert agent["livenessProbe"]["grpc"]["service"] == SERVICE
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports["grpc"] == int(config.listen.rsplit(":", 1)[1])
    assert ports["health"] == health_port and ports["metrics"] == config.metrics_port

    # Prometheus scrapes the port the annotation names, from outside the pod: not a loopback bind
    annotations = kinds["Deployment"][0]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == config.metrics_port
    assert not ipaddress.ip_address(config.metrics_host).is_loopback, "the scrape cannot reach a loopback bind"


def test_every_weightsync_command_in_deploy_parses():
    """Also commands in other documents or files added later (initContainers, Jobs)."""
    found = 0
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in _documents(path):
            spec = doc.get("spec", {}).get("template", {}).get("spec", doc.get("spec", {}))
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                argv = container.get("command", []) + container.get("args", [])
                if argv and PurePosixPath(argv[0]).name == "weightsync":
                    _parse_cli(argv, path.name)
                    found += 1
    assert found >= 1


# ------------------------------------------------------------------------------------ systemd


def test_systemd_unit_runs_a_valid_command_with_a_valid_config(tmp_path):
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    args = _parse_cli(argv, UNIT.name)
    assert args.command == "agent" and args.config == "/etc/weightsync/agent.toml"
    assert "2" in service["RestartPreventExitStatus"].split(), "a config error (exit 2) must not restart-loop"
    assert unit["Install"]["WantedBy"] == "multi-user.target"

    config = load_agent_config(SYSTEMD_TOML)
    assert config.metrics_port and not ipaddress.ip_address(config.metrics_host).is_loopback, "scraped from elsewhere"
    state = "/var/lib/" + service["StateDirectory"]
    assert config.cache_dir.startswith(state + "/"), "the cache lives in the unit's StateDirectory"
    assert state in service["ReadWritePaths"].split()


def test_deploy_tomls_use_only_known_tables():
    """load_agent_config refuses unknown keys; this guards the tables it cannot see (comments
    aside, every table in the examples is [agent] or one of its sub-tables)."""
    for text in (SYSTEMD_TOML.read_text(), yaml.safe_load_all(K8S.read_text()).__next__()["data"]["agent.toml"]):
        doc = tomllib.loads(text)
        assert set(doc) == {"agent"}


# ------------------------------------------------------------------------------ health port


def test_health_port_answers_plaintext_while_the_agent_needs_tls_and_a_token(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from harness.tls_certs import make_certificates
    from weightsync.agents.server import AgentServer
    from weightsync.transport.rpc import TlsConfig

    certs = make_certificates(tmp_path)
    config = AgentConfig(
        model="deploy-probe",
        cache_dir=str(tmp_path / "cache"),
        name="probe",
        workers=1,
        listen="127.0.0.1:0",
        health_listen="127.0.0.1:0",
        token="s3cret",
        tls=TlsConfig(cert=certs["server"], key=certs["server_key"]),
        engine={
            "type": "reference",
            "port": 0,
            "model": {
                "vocab_size": 64,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
            },
        },
    )
    server = AgentServer(config).start()
    try:
        assert server.health_address != server.address
        with grpc.insecure_channel(server.health_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            # No version served (no store, nothing pushed): not ready; alive, taking calls.
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(server.address) as channel:  # the agent's own port: TLS only
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        server.stop(grace_s=0)
