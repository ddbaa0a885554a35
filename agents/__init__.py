"""weightsync.agents: the sync agent that runs beside an inference server (receive, verify,
stage, swap), and apart from it, in `engines/`, the inference engines it drives behind one
registry. Installed as `weightsync.agents`; see docs/agents.md.

Not here: the library the agent stands on (weightsync/), the trainer.
"""
