"""weightsync.trainer: the FSDP2 trainer that produces checkpoints and publishes them from its
loop. Installed as `weightsync.trainer`; it may import weightsync, never weightsync.agents."""
