"""run: `weightsync demo` — starts the trainer, the agents and the rollout workers, watches, reports.

Order of events:
    agents     followers first (a leader needs its followers' addresses), each printing a ready
               line with its gRPC address and its reference server's URL
    trainer    torchrun, 2 ranks, SFT warm start then GRPO; publishes every step to the store and
               pushes every version to each region's leader
    workers    rollout workers, started as the warm start ends (earlier rollouts would be too stale)
    watch      a progress line per second until the trainer exits
    settle     every agent reaches the last version; each re-hashes what it serves
    report     the table per version, summary.json, summary.png
Every child is started in this module and stopped by PID (SIGTERM, then SIGKILL), in a
finally: Ctrl-C included. Logs of every child go to <out_dir>/logs/.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.app.demo.processes import stop_process_group
from weightsync.errors import ConfigError

log = logging.getLogger(__name__)

DEMO_ENGINES = ("reference", "vllm")
"""The engine types the demo can start beside its agents (of the registry's, weightsync.agents.engines)."""

_ARCH = {  # ~0.8M parameters: learns two-digit addition on two CPU cores in a few minutes
    "model_type": "qwen3",
    "vocab_size": 259,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
MOE_ARCHITECTURE = {  # the same active size as _ARCH (top-2 of 8 experts of width 192: an MLP of 384
    # per token), ~2.6M parameters in all; `weightsync demo --moe`
    **_ARCH,
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 192,
    "norm_topk_prob": True,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out_dir: str = "weightsync-demo"
    """Everything the demo writes: store (by default), agent caches, rollouts, logs, summary."""
    store: str | None = None
    """Store URI (any form `weightsync.stores.open_store` takes); default file://<out_dir>/store."""
    model: str = "demo-lm"
    regions: int = 2
    agents_per_region: int = 2
    trainer_ranks: int = 2
    warmup_steps: int = 60
    """SFT steps before GRPO."""
    rl_steps: int = 80
    """GRPO steps."""
    max_staleness_steps: int = 4
    """Rollouts sampled by weights more than this many steps older than the trainer's are dropped."""
    rollout_workers: int = 2
    group_size: int = 8
    """Completions per prompt (a GRPO group)."""
    groups_per_step: int = 4
    """Groups per optimizer step (global batch = groups_per_step x group_size)."""
    max_operand: int = 9
    """Operands of the addition task are drawn from [0, max_operand]: single digits by default, which
    the model half-learns in the warm start and GRPO then improves on within a few minutes."""
    warmup_lr: float = 3e-3
    rl_lr: float = 1e-3
    architecture: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(_ARCH))
    engine: str = "reference"
    """The inference engine beside each agent, one of DEMO_ENGINES: "reference" (the embedded
    server) or "vllm" (a real vLLM server per agent, started by the demo; needs vLLM, see
    docs/vllm.md)."""
    vllm_python: str | None = None
    """engine "vllm": the interpreter with vLLM and weightsync installed (default
    $WEIGHTSYNC_VLLM_PYTHON, else .venv-vllm/bin/python as scripts/setup_vllm.sh makes it)."""
    swap_policy: SwapPolicy = SwapPolicy.DRAIN
    """Every agent's swap policy (docs/agents.md; a string is parsed): "drain", "in_flight" or
    "abort". summary.json reports the staleness of what the trainer learned from under it."""
    rollout_tokens: int = 8
    """Tokens each completion generates. The answer takes a few; above 8 the servers keep
    generating past the end of the answer (long rollouts, as in agentic RL), so requests run
    for long and swaps meet them; the trainer still learns from the completion up to its EOS."""
    seed: int = 0
    inject_parity_fault: bool = False
    """One agent (the last) runs its parity probe under action "refuse" beside a reference engine
    that serves layers 0 and 1 swapped for three GRPO versions (`parity_fault.py`): the run shows
    the breaches, the refusals and that agent keeping the newest version that passed."""
    timeout_s: float = 1800.0
    """The whole run fails if it takes longer (a stuck child never hangs the demo)."""

    def __post_init__(self) -> None:
        if self.regions < 1 or self.agents_per_region < 1 or self.trainer_ranks < 1 or self.rollout_workers < 1:
            raise ValueError("regions, agents_per_region, trainer_ranks and rollout_workers must be >= 1")
        if self.rl_steps < 1 or self.warmup_steps < 0:
            raise ValueError("rl_steps must be >= 1 and warmup_steps >= 0")
        if (self.groups_per_step * self.group_size) % self.trainer_ranks:
            raise ValueError("groups_per_step x group_size must split evenly over trainer_ranks")
        if self.engine not in DEMO_ENGINES:
            raise ValueError(f"engine must be one of {list(DEMO_ENGINES)}, got {self.engine!r}")
        if self.inject_parity_fault and (self.engine != "reference" or self.rl_steps < 5):
            raise ValueError(
                "inject_parity_fault needs the reference engine and rl_steps >= 5 (three wrong versions mid-GRPO, "
                "then one that passes)"
            )
        object.__setattr__(self, "swap_policy", SwapPolicy.parse(self.swap_policy))
        if self.rollout_tokens < 1 or self.rollout_tokens > 1024:
            raise ValueError(
                f"rollout_tokens must be in 1..1024 (the reference server's limit), got {self.rollout_tokens}"
            )

    @property
    def model_architecture(self) -> dict[str, Any]:
        """The architecture trained and served. vLLM gets untied embeddings: its Qwen3 drops a
        separate lm_head tensor when they are tied, and every published tensor must be served."""
        if self.engine == "vllm":
            return {**self.architecture, "tie_word_embeddings": False}
        return dict(self.architecture)

    @property
    def parity_fault(self) -> tuple[str, int, int] | None:
        """(agent, first version, last version) of the injected parity fault, or None."""
        if not self.inject_parity_fault:
            return None
        first = self.warmup_steps + self.rl_steps // 2  # a version per step: mid-GRPO
        return _agent_names(self)[-1], first, first + 2

    @property
    def store_uri(self) -> str:
        return self.store or f"file://{Path(self.out_dir).resolve() / 'store'}"


class _Children:
    """Every process the demo starts, stopped by PID."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.tmp_dirs: dict[str, Path] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        ready_line: bool = False,
        env: dict[str, str] | None = None,
        tmp_dir: Path | None = None,
    ) -> tuple[subprocess.Popen, dict | None]:
        """Starts `name`; `tmp_dir`, the child's own temporary directory, is removed when it stops."""
        if tmp_dir is not None:
            self.tmp_dirs[name] = tmp_dir
        log_file = open(self.log_path(name), "w")
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if ready_line else log_file,
            stderr=log_file,
            text=True,
            start_new_session=True,
            env=env,
        )  # own group: Ctrl-C reaches us, we stop it
        self.procs[name] = proc
        if not ready_line:
            return proc, None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} exited before it was ready; see {self.log_path(name)}")
        return proc, json.loads(line)

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def stop(self, name: str, timeout_s: float = 15.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            stop_process_group(proc, timeout_s)  # torchrun's ranks and vLLM's workers are in the group too
        tmp_dir = self.tmp_dirs.pop(name, None)
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    def stop_all(self) -> None:
        for name in {**self.procs, **self.tmp_dirs}:  # a child that failed to start has its tmp_dir only
            self.stop(name)


OUT_DIR_MARKER = ".weightsync-demo"
"""Written first into every out_dir the demo makes: only a directory holding it is cleared."""

_OUT_DIR_ENTRIES = (
    OUT_DIR_MARKER, "logs", "trainer", "rollouts", "agents", "trainer.toml", "vllm-initial",
    "summary.json", "summary.png",
)  # fmt: skip
"""Everything the demo writes into out_dir, the default store ("store") aside."""


def prepare_out_dir(config: DemoConfig) -> Path:
    """out_dir, made ready for a run: created if missing, refused if it holds anything and is not
    a previous demo's output, else cleared of what the previous run wrote (stale caches,
    checkpoints and rollouts) and of nothing else: a file the user put there stays, and a store
    given with --store is never deleted. Raises ConfigError (exit 2) on a directory it may not use."""
    root = Path(config.out_dir).resolve()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--out-dir {root} is a file; give a directory the demo may create or reuse")
    if root.exists() and any(root.iterdir()) and not (root / OUT_DIR_MARKER).is_file():
        raise ConfigError(
            f"--out-dir {root} is not empty and is not a previous demo's output (no {OUT_DIR_MARKER} in it); "
            "the demo deletes nothing it did not make: give a new or empty directory"
        )
    ours = _OUT_DIR_ENTRIES + (() if config.store else ("store",))
    for name in ours:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    root.mkdir(parents=True, exist_ok=True)
    (root / OUT_DIR_MARKER).write_text("written by `weightsync demo`: the demo may clear this directory\n")
    for sub in ("logs", "trainer", "rollouts", "agents"):
        (root / sub).mkdir()
    return root


def _agent_toml(
    config: DemoConfig, root: Path, name: str, region: str, peers: list[str], vllm_url: str | None = None
) -> Path:
    arch = "\n".join(f"{k} = {json.dumps(v)}" for k, v in config.model_architecture.items())
    if vllm_url is None:
        engine = (
            f'[agent.engine]\ntype = "reference"\nport = 0\nmax_concurrent_requests = 2\n[agent.engine.model]\n{arch}\n'
        )
    else:  # the agent waits for its vLLM server to come up
        engine = f'[agent.engine]\ntype = "vllm"\nurl = "{vllm_url}"\nstart_timeout_s = {config.timeout_s}\n'
    fault = config.parity_fault
    parity = '[agent.parity]\naction = "refuse"\n' if fault and fault[0] == name else ""
    path = root / "agents" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'[agent]\nmodel = "{config.model}"\nname = "{name}"\nregion = "{region}"\n'
        f'cache_dir = "{root / "agents" / name}"\nstore = "{config.store_uri}"\npeers = {json.dumps(peers)}\n'
        "poll_interval_s = 2.0\npush_wait_s = 1.0\nworkers = 1\nledger_size = 4096\n"
        f'swap_policy = "{config.swap_policy}"\n' + engine + parity
    )
    return path


def _trainer_toml(config: DemoConfig, root: Path, leaders: list[str]) -> Path:
    arch = "\n".join(f"{k} = {json.dumps(v)}" for k, v in config.model_architecture.items())
    batch = config.groups_per_step * config.group_size
    path = root / "trainer.toml"
    path.write_text(f"""# Written by `weightsync demo`.
[parallel]
dp_shard = -1
mixed_precision = "none"

[train]
steps = {config.warmup_steps + config.rl_steps}
seed = {config.seed}
metrics_path = "{root / "trainer" / "metrics.jsonl"}"

[train.model]
init_seed = {config.seed}
{arch}

[train.optimizer]
lr = {config.warmup_lr}
betas = [0.9, 0.95]
weight_decay = 0.0
max_grad_norm = 1.0

[train.schedule]
warmup_steps = 5
decay = "constant"

[train.data]
source = "rollouts"
global_batch_size = {batch}
micro_batch_size = {batch // config.trainer_ranks}
max_seq_len = 32
seed = {config.seed}

[train.loss]
kind = "grpo"

[train.guard]
enabled = true
action = "skip"
watch = "loss/nll"              # a policy-gradient loss hovers around 0: judge the likelihood instead

[train.publish]
store = "{config.store_uri}"
model = "{config.model}"
every_steps = 1
push = {json.dumps(leaders)}
log_path = "{root / "trainer" / "publish.jsonl"}"

[train.publish.publisher]
max_in_flight = 2
workers = 1
rebase_every = 16
""")
    return path


def _tail_json(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


class ProgressLine:
    """The demo's live status: on a terminal, one line rewritten in place; elsewhere (a log file,
    CI) a line each time it changes."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.last = ""

    def __call__(self, line: str) -> None:
        if line == self.last:
            return
        self.last = line
        if self.live:
            self.stream.write("\r\033[K" + line)
            self.stream.flush()
        else:
            print(line, file=self.stream, flush=True)

    def done(self) -> None:
        if self.live and self.last:
            self.stream.write("\n")
            self.stream.flush()


def run_demo(
    config: DemoConfig, *, echo: Callable[[str], None] = print, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Runs the demo (see the module docstring); `echo` gets the report's lines, `progress` the
    live status line (default: a ProgressLine on stdout when `echo` is print, else `echo`)."""
    from weightsync.agents.parity import ParityConfig
    from weightsync.app.demo.report import build_report, write_plot
    from weightsync.app.demo.rollout_queue import RolloutQueue
    from weightsync.format import codecs
    from weightsync.stores import open_store
    from weightsync.transport.rpc import AgentClient
    from weightsync.versions import latest_version, read_manifest

    # Every argument is checked before the disk is touched: a bad store URI or a missing vLLM
    # must not cost the user a previous run's output (opening a store reads nothing and writes
    # nothing).
    store = open_store(config.store_uri)
    vllm_python = _find_vllm_python(config) if config.engine == "vllm" else None
    root = prepare_out_dir(config)
    children = _Children(root / "logs")
    deadline = time.monotonic() + config.timeout_s
    python = sys.executable
    try:
        # numba compiles the ctx and rans kernels on their first use (seconds per element width on a fresh
        # install) and caches them on disk: once here, not in the trainer and every agent at once
        # when the first delta comes.
        codecs.warm_up(["bfloat16", "float32"])
        vllm_urls = _start_vllm_servers(config, root, children, vllm_python, deadline) if vllm_python else {}
        # -- agents: per region, followers first so the leader knows where to relay
        agents: dict[str, dict] = {}
        leaders = []
        for r in range(config.regions):
            region = f"region-{chr(ord('a') + r)}"
            downstream: list[str] = []
            for i in reversed(range(config.agents_per_region)):
                name = f"{region}-{i + 1}"
                toml = _agent_toml(config, root, name, region, downstream, vllm_urls.get(name))
                argv = [python, "-m", "weightsync.app.cli", "agent", "--config", str(toml), "--verbose"]
                fault = config.parity_fault
                if fault and fault[0] == name:
                    argv = [python, "-m", "weightsync.app.demo.parity_fault", "--config", str(toml)]
                    argv += ["--versions", f"{fault[1]}-{fault[2]}"]
                _, ready = children.start(name, argv, ready_line=True)  # INFO: each version served
                agents[name] = {"region": region, "address": ready["address"], "engine_url": ready["engine_url"]}
                downstream = [ready["address"]]
            leaders.append(downstream[0])
        echo(
            f"weightsync demo: {len(agents)} agents in {config.regions} regions serving {config.model} "
            f"({config.architecture['model_type']}; {config.engine} engines, swap policy {config.swap_policy}, "
            f"rollouts of {config.rollout_tokens} tokens); store {config.store_uri}"
        )

        # -- trainer
        trainer_argv = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={config.trainer_ranks}",
            "-m",
            "weightsync.app.demo.rl",
            "--config",
            str(_trainer_toml(config, root, leaders)),
            "--rollouts",
            str(root / "rollouts"),
            "--export-dir",
            str(root / "trainer" / "warm-start"),
            f"--warmup-steps={config.warmup_steps}",
            f"--rl-steps={config.rl_steps}",
            f"--rl-lr={config.rl_lr}",
            f"--max-staleness-steps={config.max_staleness_steps}",
            f"--max-operand={config.max_operand}",
            "--log-level=WARNING",
        ]
        trainer, _ = children.start("trainer", trainer_argv)
        echo(
            f"trainer: {config.trainer_ranks} ranks (FSDP2, gloo), {config.warmup_steps} SFT warm-start steps "
            f"then {config.rl_steps} GRPO steps, publishing every step"
        )

        # -- watch, starting the rollout workers as the warm start ends
        queue = RolloutQueue(root / "rollouts")
        clients = {name: AgentClient(a["address"]) for name, a in agents.items()}
        workers_started = False
        status = progress or (ProgressLine() if echo is print else echo)
        while trainer.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the demo did not finish in {config.timeout_s:.0f} s; see {root / 'logs'}")
            metrics = _tail_json(root / "trainer" / "metrics.jsonl")
            step = metrics[-1]["step"] if metrics else 0
            if not workers_started and step >= max(0, config.warmup_steps - config.max_staleness_steps):
                _start_workers(config, root, agents, children)
                workers_started = True
            status(_progress_line(config, step, metrics, store, clients, queue, root))
            time.sleep(1.0)
        if isinstance(status, ProgressLine):
            status.done()
        if trainer.returncode != 0:
            raise RuntimeError(
                f"the trainer exited with code {trainer.returncode}; see {root / 'logs' / 'trainer.log'}"
            )
        for name in [n for n in children.procs if n.startswith("rollouts-")]:
            children.stop(name)

        # -- settle: every agent on the last version, serving exactly its bytes
        latest = latest_version(store, config.model)
        final = read_manifest(store, config.model, latest)
        statuses = {}
        for name, client in clients.items():
            while client.status().current_version < latest:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not reach v{latest}")
                time.sleep(0.2)
            # The parity probe runs after the swap: its report of the last version, for the summary.
            probe_deadline = min(deadline, time.monotonic() + 60)
            while "probe" in final.producer and client.status().parity.version < latest:
                if time.monotonic() > probe_deadline:
                    break  # an engine that does not answer probes: the summary says None
                time.sleep(0.2)
            statuses[name] = client.status(verify=True)
        bit_exact = {name: s.served_digest == s.current_digest == final.digest for name, s in statuses.items()}
        report = build_report(config, root, store, statuses, queue, ParityConfig())
        summary = {
            "config": dataclasses.asdict(config),
            "store": config.store_uri,
            "last_version": latest,
            "agents": {
                name: {**agents[name], "version": int(s.current_version), "bit_exact": bit_exact[name]}
                for name, s in statuses.items()
            },
            "all_bit_exact": all(bit_exact.values()),
            **report,
        }
        (root / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        plot = write_plot(summary, root / "summary.png")
        for line in summary["table"]:
            echo(line)
        echo(summary["headline"])
        for line in _parity_lines(summary["parity"], config, root):
            echo(line)
        echo(
            f"every agent serves v{latest} bit for bit: {'yes' if summary['all_bit_exact'] else 'NO'} "
            f"(each re-hashed the weights it serves). Summary: {root / 'summary.json'}"
            + (f", plot: {plot}" if plot else ", no plot: pip install 'weightsync[demo]' (matplotlib) for summary.png")
        )
        for client in clients.values():
            client.close()
        return summary
    finally:
        children.stop_all()


def _parity_lines(parity: dict[str, Any], config: DemoConfig, root: Path) -> list[str]:
    """What the parity probe saw, for the demo's output: each figure's distribution against its
    threshold, the breaches, and with an injected fault the faulty agent's own log lines about it."""
    if not parity["probes"]:
        return []
    lines = [
        f"parity probe: {parity['probes']} probes, engines held to the trainer's "
        f"{'/'.join(parity['compute_dtypes'])} record: {parity['breaches']} breaches"
    ]
    for figure, dist in parity["figures"].items():
        limit = parity["thresholds"].get(figure)
        lines.append(
            f"  {figure:<16} median {dist['median']:.3g}, p99 {dist['p99']:.3g}, max {dist['max']:.3g}"
            + (f" (threshold {limit:g})" if limit is not None else " (a figure, no threshold)")
        )
    fault = config.parity_fault
    if fault is not None:
        name, first, last = fault
        lines.append(f"injected parity fault: {name}'s engine served layers 0 and 1 swapped for v{first}-v{last}:")
        try:
            logged = (root / "logs" / f"{name}.log").read_text().splitlines()
        except OSError:
            logged = []
        said = [line for line in logged if "breaches parity" in line or "the newest version that passed" in line]
        lines.extend(f"  {line}" for line in said[:6])
    return lines


def _agent_names(config: DemoConfig) -> list[str]:
    return [
        f"region-{chr(ord('a') + r)}-{i + 1}" for r in range(config.regions) for i in range(config.agents_per_region)
    ]


def _find_vllm_python(config: DemoConfig) -> str:
    from weightsync.app.demo.vllm import find_vllm_python

    python = find_vllm_python(config.vllm_python)
    if python is None:
        raise ConfigError(
            "--engine vllm needs vLLM: run `bash scripts/setup_vllm.sh` (makes .venv-vllm) or give "
            "--vllm-python / $WEIGHTSYNC_VLLM_PYTHON, an interpreter with vLLM and weightsync"
        )
    return python


def _start_vllm_servers(
    config: DemoConfig, root: Path, children: _Children, python: str, deadline: float
) -> dict[str, str]:
    """One vLLM server per agent, all starting at once on the initial weights of the architecture
    (the agents swap the published versions in), each answering before this returns; {agent name:
    server URL}."""
    from weightsync.app.demo.vllm import free_port, server_tmp_dir, vllm_server_command, wait_until_serving
    from weightsync.models import ModelConfig, build_model, save_pretrained

    model_config = ModelConfig(**config.model_architecture)
    model_dir = root / "vllm-initial"
    save_pretrained(model_dir, model_config, build_model(model_config, seed=config.seed).state_dict())  # bf16
    urls = {}
    for name in _agent_names(config):
        port = free_port()
        tmp_dir = server_tmp_dir()
        argv, env = vllm_server_command(python, model_dir, port, tmp_dir=tmp_dir, max_model_len=64)
        children.start(f"{name}-vllm", argv, env=env, tmp_dir=tmp_dir)
        urls[name] = f"http://127.0.0.1:{port}"
    for name, url in urls.items():
        wait_until_serving(children.procs[f"{name}-vllm"], url, children.log_path(f"{name}-vllm"), deadline)
    return urls


def _start_workers(config: DemoConfig, root: Path, agents: dict, children: _Children) -> None:
    servers = [a["engine_url"] for a in agents.values()]
    for w in range(config.rollout_workers):
        worker = {
            "servers": servers,
            "queue_dir": str(root / "rollouts"),
            "store": config.store_uri,
            "model": config.model,
            "worker": f"w{w}",
            "group_size": config.group_size,
            "max_operand": config.max_operand,
            "seed": config.seed + w,
            "engine": config.engine,
            "max_new_tokens": config.rollout_tokens,
            "stats_path": str(root / "rollouts" / f"stats-w{w}.jsonl"),
        }
        children.start(f"rollouts-w{w}", [sys.executable, "-m", "weightsync.app.demo.rollouts", json.dumps(worker)])


def _progress_line(config: DemoConfig, step: int, metrics: list[dict], store, clients: dict, queue, root: Path) -> str:
    from weightsync.versions import latest_version

    phase = "warm-up" if step <= config.warmup_steps else "grpo"
    latest = latest_version(store, config.model) or 0
    served = []
    for name, client in clients.items():
        try:
            served.append(f"{name.split('-', 1)[1]} v{client.status(timeout_s=2).current_version}")
        except Exception:  # an agent busy or restarting: the line says so instead of stopping the demo
            served.append(f"{name.split('-', 1)[1]} ?")
    stats = [row for w in range(config.rollout_workers) for row in _tail_json(root / "rollouts" / f"stats-w{w}.jsonl")]
    recent = stats[-32:]
    reward = f"reward {sum(r['reward'] for r in recent) / len(recent):.2f}" if recent else "reward -"
    loss = f"loss {metrics[-1].get('loss', float('nan')):.3f}" if metrics else "loss -"
    stale = metrics[-1].get("data/staleness_steps") if metrics else None
    counts = queue.counts()
    return (
        f"step {step:>3}/{config.warmup_steps + config.rl_steps} {phase:<7} {loss} | committed v{latest} | "
        f"serving {', '.join(served)} | {reward} | rollouts queued {counts['pending']} used {counts['claimed']} "
        f"dropped {counts['dropped']}" + (f" | staleness {stale:.1f}" if stale is not None else "")
    )
