"""parity_fault: `weightsync demo --inject-parity-fault` — one agent whose engine computes wrong.

Run as `python -m weightsync.app.demo.parity_fault --config AGENT.toml --versions FIRST-LAST`: the
agent of AGENT.toml (its [agent.parity] action "refuse"), beside a reference server that, for the
versions FIRST..LAST, serves decoder layers 0 and 1 swapped after the agent verified every byte —
what a loader that numbers layers wrongly would do. Every digest passes; the parity probe catches
it, and the refuse rule keeps the newest version that passed served until a good one comes. It
prints the agent's ready line, as `weightsync agent` does, so the demo starts it the same way.

Not here: the demo itself (`run.py`), the probe and the rule (`weightsync.agents.parity`, `sync.py`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping

import torch

from weightsync.agents.config import load_agent_config
from weightsync.agents.engines import parse_engine_config
from weightsync.agents.engines.reference_server import ReferenceServer, ReferenceServerConfig
from weightsync.agents.server import run_agent
from weightsync.app.cli.agent import print_ready_line
from weightsync.logs import configure_logging


class SwappedLayersServer(ReferenceServer):
    """The reference server, but serving layers 0 and 1 swapped for the versions in `wrong`."""

    def __init__(self, config: ReferenceServerConfig, wrong: range) -> None:
        super().__init__(config)
        self.wrong = wrong

    def swap(self, version: int, weights: Mapping[str, torch.Tensor], **kwargs):
        if version in self.wrong:
            weights = with_layers_0_and_1_swapped(weights)
        return super().swap(version, weights, **kwargs)


def with_layers_0_and_1_swapped(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with decoder layers 0 and 1 traded: every byte verifies, the numbers are wrong."""
    swapped = dict(weights)
    for name in weights:
        if name.startswith("model.layers.0."):
            other = name.replace("layers.0.", "layers.1.")
            swapped[name], swapped[other] = weights[other], weights[name]
    return swapped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the agent's TOML (a reference engine)")
    parser.add_argument("--versions", required=True, help="FIRST-LAST: the versions served wrong")
    args = parser.parse_args(argv)
    first, last = (int(v) for v in args.versions.split("-"))
    config = load_agent_config(args.config)
    configure_logging(logging.INFO, agent=config.name, region=config.region)
    engine = SwappedLayersServer(parse_engine_config(config.engine, where=args.config), range(first, last + 1))
    engine.start()
    run_agent(config, ready=print_ready_line, engine=engine)


if __name__ == "__main__":
    main()
