"""cli.agent: the sync agent's commands: agent (run one), status (ask one), keygen (the key pair
that signs what agents trust).

Not here: the agent itself (weightsync.agents), the store commands (`versions.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

# Light (standard library only): the registry's names and the swap policies, for choices and help.
from weightsync.agents.engines import engine_types
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.app.cli.common import Failed, add_common_flags, add_log_format_flag, format_size
from weightsync.listen import AGENT_PORT
from weightsync.stores import store_uri_forms


def _cmd_agent(args: argparse.Namespace) -> dict[str, Any]:
    config = agent_config(args)
    from weightsync.agents.server import run_agent  # after the config is known good: it imports torch
    from weightsync.logs import configure_logging

    configure_logging(
        logging.INFO if args.verbose else logging.WARNING, args.log_format, agent=config.name, region=config.region
    )

    run_agent(config, ready=print_ready_line)
    return {"agent": config.name, "stopped": True}


def print_ready_line(server) -> None:
    """One line on stdout as soon as the agent listens: what scripts (and the demo) wait for."""
    print(
        json.dumps(
            {
                "event": "ready",
                "agent": server.config.name,
                "address": server.address,
                "engine_url": server.engine.url,
                "metrics_port": server.metrics_port,
            }
        ),
        flush=True,
    )


def agent_config(args: argparse.Namespace):
    """The AgentConfig `weightsync agent` runs with: --config's file with the flags on top, every
    flag applied or refused with a reason (ConfigError)."""
    from weightsync.agents.config import load_agent_config
    from weightsync.errors import ConfigError

    engine_flags = {flag: (option, getattr(args, dest)) for flag, (dest, option) in _ENGINE_FLAGS.items()}
    if args.config is None and args.store is None and all(value is None for _, value in engine_flags.values()):
        raise ConfigError(
            "weightsync agent needs an engine: give --store URI (the reference engine, its architecture read from "
            "the store), --model-dir DIR (the reference engine serving that HF directory), --engine TYPE with its "
            "settings (e.g. --engine vllm --engine-url http://127.0.0.1:8000), or --config FILE with an "
            "[agent.engine] table"
        )
    return load_agent_config(
        args.config,
        engine_flags=engine_flags,
        model=args.model,
        cache_dir=args.cache_dir,
        name=args.name,
        region=args.region,
        listen=args.listen,
        health_listen=args.health_listen,
        store=args.store,
        peers=tuple(args.peer) or None,
        token_file=args.token_file,
        trusted_keys=tuple(args.trusted_key) or None,
        require_signatures=args.require_signatures or None,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        poll_interval_s=args.poll_interval_s,
        swap_policy=args.swap_policy,
    )


_ENGINE_FLAGS = {  # flag -> (argparse dest, the [agent.engine] option it sets)
    "--engine": ("engine", "type"),
    "--model-dir": ("model_dir", "model_dir"),
    "--engine-port": ("engine_port", "port"),
    "--engine-url": ("engine_url", "url"),
    "--engine-root": ("engine_root", "root"),
    "--template-dir": ("template_dir", "template_dir"),
    "--reload-url": ("reload_url", "reload_url"),
}


def _cmd_status(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.listen import agent_target
    from weightsync.transport.rpc import AgentClient, TlsConfig, read_token
    from weightsync.transport.v1 import sync_pb2

    tls = TlsConfig(ca=args.ca, cert=args.cert, key=args.key, server_name=args.server_name) if args.ca else None
    client = AgentClient(agent_target(args.agent), tls=tls, token=read_token(token_file=args.token_file))
    try:
        reply = client.status(timeout_s=args.timeout_s, verify=args.verify)
    finally:
        client.close()
    row = _message_json(reply)
    if not reply.HasField("engine_state"):  # an agent from before engine states: its own word for both
        reply.engine_state.state, reply.engine_state.version = sync_pb2.EngineState.SERVING, reply.current_version
        if args.verify:
            same = bool(reply.served_digest) and reply.served_digest == reply.current_digest
            reply.verification.ok, reply.verification.hashed = same, "the bytes the agent serves (an older agent)"
            reply.verification.error = "" if same else f"they hash to {reply.served_digest!r}"
    engine = reply.engine_state
    engine_state = sync_pb2.EngineState.State.Name(engine.state)
    engine_serving = engine.state == sync_pb2.EngineState.SERVING and engine.version == reply.current_version
    if not args.json:
        serving = (
            f"serving {reply.model} v{reply.current_version} [{reply.current_digest[:12]}]"
            if reply.current_version
            else f"serving nothing of {reply.model}"
        )
        engine_says = (
            f"serving v{engine.version}" if engine.state == sync_pb2.EngineState.SERVING else engine_state
        ) + (f" ({engine.reason})" if engine.reason else "")
        print(
            f"agent {reply.agent} ({reply.region}) {serving}, newest known v{reply.target_version}, "
            f"engine {reply.engine}: {engine_says}, peers {list(reply.peers) or '-'}"
        )
        if reply.unhealthy:
            print(f"not healthy: {reply.unhealthy}")
        if args.verify:
            check = reply.verification
            if check.hashed == "nothing":
                print(f"not verified: {check.error}")
            else:
                verdict = f"bit-exact, {reply.served_digest}" if check.ok else f"MISMATCH: {check.error}"
                print(f"verified {check.hashed}: {verdict}")
        if reply.last_error:
            print(f"last error: {reply.last_error}")
        for b in reply.broken:  # never served; retried while an older good version is served
            print(f"broken v{b.version}: {b.failures} failed attempts, next in {b.retry_in_s:.1f}s: {b.error}")
        if reply.HasField("parity"):  # the newest parity probe (docs/agents.md, "Parity probe")
            print(parity_line(reply.parity))
        if reply.refused:
            print(f"refused by the parity probe (never served again): {', '.join(f'v{v}' for v in reply.refused)}")
        print(
            f"{'version':>7} {'outcome':>10} {'source':>14} {'pushed':>10} {'fetched':>10} {'total':>8} "
            f"{'pause':>8}  path / error"
        )
        for e in reply.ledger:
            total = e.timings_s.get("since_offer")
            pause = e.timings_s.get("swap_pause")
            into = f", swapped {'in place' if e.swap_path == 'delta' else 'whole'}" if e.swap_path else ""
            print(
                f"{e.version:>7} {e.outcome:>10} {e.source[:14]:>14} {format_size(e.bytes_pushed):>10} "
                f"{format_size(e.bytes_fetched):>10} {'-' if total is None else f'{total:.3f}s':>8} "
                f"{'-' if pause is None else f'{1000 * pause:.2f}ms':>8}  {e.error or e.path + into}"
            )
    if args.verify:
        if not reply.current_version:
            why = f": {reply.unhealthy}" if reply.unhealthy else ""
            raise Failed(row, f"agent {reply.agent} serves no version of {reply.model}{why}")
        if not engine_serving:
            raise Failed(
                row,
                f"the {reply.engine} engine does not serve v{reply.current_version}: {engine_state}"
                + (f" v{engine.version}" if engine.state == sync_pb2.EngineState.SERVING else "")
                + (f" ({engine.reason})" if engine.reason else ""),
            )
        if not reply.verification.ok:
            raise Failed(row, f"v{reply.current_version} does not verify: {reply.verification.error}")
    return row


def parity_line(p) -> str:
    """A ParityReport in one line: the record the engine was held to, the figures, the verdict.
    Each figure names what it is over: the log-prob figures the tokens compared, the expert
    mismatch the positions whose routing was recorded (every prompt token: more than the tokens;
    the line once said "124 tokens" of a fraction over 128 positions)."""
    figures = [f"held to the {p.compute_dtype or '?'} record"]
    if p.HasField("dlogprob_p50"):
        figures.append(
            f"|dlogprob| median {p.dlogprob_p50:.3g}, p90 {p.dlogprob_p90:.3g}, max {p.max_abs_dlogprob:.3g}"
        )
    figures[-1] += f" over {p.tokens} tokens"
    if p.HasField("expert_mismatch"):
        over = f" over {p.expert_positions} positions" if p.expert_positions else ""
        figures.append(f"expert mismatch {p.expert_mismatch:.3g}{over}")
    if p.HasField("gap_kl"):
        figures.append(f"training/inference gap KL {p.gap_kl:.3g} (top-k overlap {p.gap_overlap:.2f})")
    verdict = "ok" if p.action == "ok" else f"{p.action.upper()}: {'; '.join(p.breaches)}"
    return f"parity v{p.version} on {p.engine}: {', '.join(figures)}, {1000 * p.probe_s:.0f} ms: {verdict}"


def _message_json(message) -> dict[str, Any]:
    """A protobuf message as JSON-ready data with every field present, integers as numbers
    (MessageToDict writes 64-bit integers as strings) and enums by name."""
    from google.protobuf.descriptor import FieldDescriptor
    from google.protobuf.json_format import MessageToDict

    doc = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    int64 = {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }

    def numbers(descriptor, value):
        message_type = descriptor.message_type
        if isinstance(value, dict) and message_type is not None and not message_type.GetOptions().map_entry:
            return fix(message_type, value)
        if descriptor.type in int64 and isinstance(value, str):
            return int(value)
        return value

    def fix(message_type, doc: dict) -> dict:
        for field in message_type.fields:
            if field.name not in doc:
                continue
            value = doc[field.name]
            if isinstance(value, list):  # a repeated field
                doc[field.name] = [numbers(field, v) for v in value]
            else:
                doc[field.name] = numbers(field, value)
        return doc

    return fix(message.DESCRIPTOR, doc)


def _cmd_keygen(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.transport.signing import Signer

    signer = Signer.generate()
    private, public = f"{args.out}.pem", f"{args.out}.pub"
    signer.write(private, public)  # ConfigError (exit 2) for a missing directory or an existing key
    if not args.json:
        print(
            f"wrote {private} (private, mode 600: give it to the publisher) and {public} "
            f"(public: give it to agents as a trusted key); key id {signer.key_id}"
        )
    return {"private_key": private, "public_key": public, "key_id": signer.key_id}


def _add_agent(sub) -> None:
    p = sub.add_parser(
        "agent",
        help="run a sync agent beside an inference engine",
        description="Run a sync agent: receive pushed versions, relay them to peers, fetch what is "
        "missing from the store, verify everything, hot-swap the engine's weights. "
        "Settings come from --config (TOML, [agent] table) and the flags below. "
        "Prints one JSON line when listening; stops gracefully on SIGTERM/SIGINT.",
    )
    add_common_flags(p, store=False, model=False)
    p.add_argument("--config", help="agent TOML file (see agents/config.py)")
    p.add_argument("--model", help="model name this agent serves")
    p.add_argument("--cache-dir", help="local cache directory (crash-safe; a restart serves from it)")
    p.add_argument("--store", help=f"store URI to fetch from and poll: {store_uri_forms()}")
    p.add_argument("--listen", help="gRPC host:port (default 127.0.0.1:0)")
    p.add_argument("--health-listen", help="plaintext host:port serving only gRPC health (Kubernetes grpc probes)")
    p.add_argument("--name", help="agent name (default: hostname)")
    p.add_argument("--region", help="region name (default 'default')")
    p.add_argument("--peer", action="append", default=[], help="downstream agent host:port to relay to (repeatable)")
    engine = p.add_argument_group(
        "engine",
        "The inference engine beside the agent. Each flag sets one [agent.engine] option, on top of the "
        "--config file's table; one the engine type lacks is refused. Other options: the --config file "
        "(docs/agents.md, Engines).",
    )
    engine.add_argument(
        "--engine",
        choices=engine_types(),
        help="engine type (default: the --config file's, else reference); must agree with the --config file's",
    )
    engine.add_argument(
        "--model-dir",
        help="reference: HF-style directory giving the engine its architecture and first weights (default, with "
        "--store: the architecture from the config.json the model's versions carry, the weights from the store)",
    )
    engine.add_argument("--engine-port", type=int, help="reference: its HTTP port (default: any free port)")
    engine.add_argument("--engine-url", help="vllm, sglang: the server's base URL, e.g. http://127.0.0.1:8000")
    engine.add_argument("--engine-root", help="safetensors_dir, sglang: the directory snapshots are written to")
    engine.add_argument(
        "--template-dir", help="safetensors_dir, sglang: HF directory whose config and tokenizer go into each snapshot"
    )
    engine.add_argument("--reload-url", help="safetensors_dir: the URL that has the server reload a snapshot")
    p.add_argument("--token-file", help="bearer token callers must present (or $WEIGHTSYNC_TOKEN)")
    p.add_argument("--trusted-key", action="append", default=[], help="publisher public key (PEM), repeatable")
    p.add_argument("--require-signatures", action="store_true", help="refuse unsigned versions")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: any)")
    p.add_argument(
        "--metrics-host",
        help="address /metrics binds (default 127.0.0.1: this host only; 0.0.0.0 for a Prometheus elsewhere)",
    )
    p.add_argument("--poll-interval-s", type=float, help="how often to check the store for new versions")
    p.add_argument(
        "--swap-policy",
        choices=SwapPolicy.names(),
        help="how requests running at a swap meet the new version (default drain; docs/agents.md)",
    )
    add_log_format_flag(p)
    p.set_defaults(handler=_cmd_agent)


def _add_status(sub) -> None:
    p = sub.add_parser(
        "status",
        help="show an agent's version, its engine's state, ledger and last error",
        description="Ask a running agent for its current version, what its engine serves (serving, or "
        "empty, paused, unreachable, with the reason), its ledger of recent versions (path, bytes pushed "
        "and fetched, timings) and its last error.",
    )
    add_common_flags(p, store=False, model=False)
    p.add_argument(
        "--agent",
        required=True,
        help=f"agent gRPC address host:port (a host alone: port {AGENT_PORT}, the one the examples and deploy/ use)",
    )
    p.add_argument("--token-file", help="bearer token file (or $WEIGHTSYNC_TOKEN)")
    p.add_argument("--ca", help="CA certificate (PEM) to verify a TLS agent")
    p.add_argument("--cert", help="client certificate (PEM) for mTLS")
    p.add_argument("--key", help="client key (PEM) for mTLS")
    p.add_argument("--server-name", help="name to check the agent's certificate against")
    p.add_argument("--timeout-s", type=float, default=10.0, help="deadline of the call (default 10)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="have the agent re-hash its copy of the served version against the version's digest and, where "
        "the engine reports a digest of what it holds (vllm, reference), have the engine compare what it holds "
        "with that copy; the output says what was hashed. Exit 1 unless they match and the engine serves "
        "that version (also when nothing is served)",
    )
    p.set_defaults(handler=_cmd_status)


def _add_keygen(sub) -> None:
    p = sub.add_parser("keygen", help="make an Ed25519 key pair for signing manifests")
    add_common_flags(p, store=False, model=False)
    p.add_argument("--out", required=True, help="path prefix: writes PREFIX.pem (private) and PREFIX.pub")
    p.set_defaults(handler=_cmd_keygen)


def add_parsers(sub) -> None:
    for add in (_add_agent, _add_status, _add_keygen):
        add(sub)
