"""training: a self-hosted training service that speaks the Tinker SDK's HTTP protocol.

Unmodified `tinker` code (`tinker.ServiceClient(base_url=...)`) drives the project's training
engine (`weightsync.trainer`, the same one `weightsync train` runs) through it:
forward_backward / optim_step / save_weights_for_sampler / save_state, with sampling on an
engine that a weightsync agent keeps in sync. This package is the HTTP front end only; every
request that trains becomes a command that each rank runs on its engine
(`weightsync.trainer.commands`). One module per concept:

    errors.py     the error categories the SDK understands (user / server) and their HTTP codes
    futures.py    request ids, pending results and the long-poll of retrieve_future
    ordering.py   a model's requests run in seq_id order, whatever order they arrive in
    wire.py       protobuf / JSON bodies <-> plain data (the only module that knows the schema),
                  and a request's checks against the loss and LoRA settings it names
    sampling.py   sampling clients on engines that weightsync agents keep in sync
    vllm_sampling.py  sample requests on a vLLM server that an agent keeps in sync
    profiles.py   named, versioned training presets (profiles/*.toml)
    service.py    sessions, models, checkpoints, sampler weights: what each route does
    http.py       the HTTP server: routes -> service, errors -> status codes
    serve.py      `weightsync serve-training`: rank 0 serves, the other ranks follow

Not here: training — the model on the ranks, forward/backward, the optimizer step, checkpoints,
LoRA and the losses (`weightsync.trainer`: engine.py, commands.py, lora.py, losses.py); the
weight transport (`weightsync.publisher`).
"""
