"""Metrics an operator can read and reach: every metric the code records is declared once in
`weightsync.metrics.METRICS` with a HELP string that says what it measures (it was the placeholder
"weightsync agent/version"), an undeclared name is refused, and an agent binds /metrics on
`metrics_host` (it was loopback only, out of reach of the Prometheus scrape in deploy/kubernetes/).
"""

from __future__ import annotations

import dataclasses
import re
import urllib.request
from pathlib import Path

import pytest

from harness.fake_trainer import TINY
from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.metrics import COUNTERS, METRICS, PrometheusMetrics, prometheus_name

REPO = Path(__file__).resolve().parents[1]
RECORDED = re.compile(r"""\.(?:inc|set|observe)\(\s*["']([a-z][a-z0-9_]*(?:/[a-z][a-z0-9_]*)+)["']""")


def _source_files() -> list[Path]:
    """The source files that record metrics (weightsync/metrics.py's docstring examples aside)."""
    return [
        path
        for folder in ("weightsync", "agents", "app", "trainer")
        for path in sorted((REPO / folder).rglob("*.py"))
        if not (path.name == "metrics.py" and path.parent.name == "weightsync")
    ]


def _sources() -> list[str]:
    return [path.read_text() for path in _source_files()]


def _recorded_names() -> dict[str, list[str]]:
    """Every metric name a source file records, with where."""
    names: dict[str, list[str]] = {}
    for path in _source_files():
        for name in RECORDED.findall(path.read_text()):
            names.setdefault(name, []).append(str(path.relative_to(REPO)))
    return names


def test_every_metric_the_code_records_is_declared_with_what_it_measures():
    recorded = _recorded_names()
    assert {"agent/version", "agent/swap_pause_s", "push/bytes_sent", "publish/ratio"} <= set(recorded)
    undeclared = {name: where for name, where in recorded.items() if name not in METRICS}
    assert not undeclared, f"declare these in weightsync/metrics.py METRICS: {undeclared}"
    unused = sorted(set(METRICS) - set(recorded))
    assert not unused, f"METRICS declares names nothing records: {unused}"
    for name, help_text in METRICS.items():
        assert help_text.endswith(".") and len(help_text.split()) >= 5, f"{name}: say what it measures"
        assert name not in help_text, f"{name}: the HELP string repeats the name instead of saying what it is"


def test_the_exposition_carries_each_metrics_help_and_an_undeclared_name_is_refused():
    metrics = PrometheusMetrics(agent="a")
    metrics.set("agent/version", 3)
    metrics.inc("agent/bytes_received", 10, source="push")
    text = metrics.exposition().decode()
    assert f"# HELP {prometheus_name('agent/version')} {METRICS['agent/version']}" in text
    assert "# HELP weightsync_agent_bytes_received_total Object bytes received, by source" in text
    assert "weightsync agent/" not in text
    with pytest.raises(ValueError, match="not declared"):
        metrics.inc("agent/made_up")


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_an_agent_binds_metrics_on_metrics_host_and_says_whether_it_serves(tmp_path, host):
    config = AgentConfig(
        model="metrics-lm",
        cache_dir=str(tmp_path / "cache"),
        engine={"type": "reference", "model": dataclasses.asdict(TINY), "port": 0},
        workers=1,
        metrics_port=0,
        metrics_host=host,
    )
    server = AgentServer(config).start()
    try:
        assert server.metrics._server.server_address[0] == host
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()
        assert re.search(r"^weightsync_agent_serving\{.*\} 0\.0$", text, re.M), text  # nothing served yet
        # Counters are there at 0 before their first event (they were missing until it).
        assert re.search(r"^weightsync_agent_errors_total\{.*\} 0\.0$", text, re.M), text
        assert re.search(r'^weightsync_agent_bytes_received_total\{.*source="store".*\} 0\.0$', text, re.M), text
    finally:
        server.stop(0)


def test_every_counter_is_declared_with_its_labels_and_starts_at_zero():
    """A counter used to appear in /metrics only at its first increment: an alert on errors read
    "no data" until the first error."""
    recorded = set(re.findall(r"""\.inc\(\s*["']([a-z][a-z0-9_/]+)["']""", "".join(_sources())))
    assert recorded == set(COUNTERS), "declare every counter in weightsync.metrics.COUNTERS, with its labels' values"
    metrics = PrometheusMetrics(model="m")
    metrics.start_counters("publish")
    text = metrics.exposition().decode()
    for line in (
        'weightsync_publish_versions_total{kind="delta",model="m"} 0.0',
        'weightsync_publish_versions_total{kind="full",model="m"} 0.0',
        'weightsync_publish_failures_total{model="m"} 0.0',
    ):
        assert line in text.splitlines(), text
    assert "weightsync_agent_" not in text


@pytest.mark.parametrize("value", ["0.0.0.0:9400", "", "host name"])
def test_metrics_host_is_checked_like_the_other_addresses(tmp_path, value):
    with pytest.raises(ValueError, match="metrics_host must be an address or host name without a port"):
        AgentConfig(model="m", cache_dir=str(tmp_path), metrics_port=9400, metrics_host=value)
