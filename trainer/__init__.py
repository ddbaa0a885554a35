"""weightsync.trainer: the one training engine (engine.py: the FSDP2-sharded model, its optimizer,
checkpoints, LoRA, every loss) and its two drivers: the TOML loop that publishes from inside it
(train.py) and the Training API's commands on every rank (commands.py). Installed as
`weightsync.trainer`; it may import weightsync, never weightsync.agents or weightsync.app."""
