"""weightsync.agents: the sync agent that runs beside an inference server (receive, verify,
stage, swap) and its engine adapters. Installed as `weightsync.agents`; see docs/agents.md."""
