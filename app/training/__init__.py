"""training: a self-hosted training service that speaks the Tinker SDK's HTTP protocol.

Unmodified `tinker` code (`tinker.ServiceClient(base_url=...)`) drives the project's FSDP2
trainer through it: forward_backward / optim_step / save_weights_for_sampler / save_state,
with sampling on an engine that a weightsync agent keeps in sync. One module per concept:

    errors.py     the error categories the SDK understands (user / server) and their HTTP codes
    futures.py    request ids, pending results and the long-poll of retrieve_future
    ordering.py   a model's requests run in seq_id order, whatever order they arrive in
    wire.py       protobuf / JSON bodies <-> plain tensors (the only module that knows the schema)
    losses.py     the loss functions the SDK names (cross_entropy, importance_sampling, ppo, cispo)
    lora.py       LoRA adapters on the decoder's linear layers; merging them into the weights
    worker.py     the sharded model on one rank and the collective commands rank 0 sends
    sampling.py   sampling clients on engines that weightsync agents keep in sync
    profiles.py   named, versioned training presets (profiles/*.toml)
    service.py    sessions, models, checkpoints, sampler weights: what each route does
    http.py       the HTTP server: routes -> service, errors -> status codes
    serve.py      `weightsync serve-training`: rank 0 serves, the other ranks follow

Not here: the model (`weightsync.models`), FSDP2 sharding (`weightsync.trainer.parallel`),
the weight transport (`weightsync.publisher`).
"""
