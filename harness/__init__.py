"""harness: what the tests and the benchmarks both stand on, one module per concept.

    moto.py          moto's S3 in its own process (a real S3-compatible HTTP server)
    fault_proxy.py   an HTTP proxy that breaks S3 traffic on purpose (errors, resets, flips)
    tcp_relay.py     a TCP relay for one link that can flip bytes or hold traffic (a partition)
    fake_trainer.py  the trainer's stand-in: a small decoder nudged sparsely each step
    machine.py       describe_machine(): what a result records about the machine it ran on
    bits.py          bit-for-bit equality of tensors and state dicts
    vllm.py          a real vLLM server (its venv, a tiny Qwen3 written by transformers, start/stop)

Not installed with the wheel: it is found from the repository root (pytest's `pythonpath = ["."]`,
benchmarks run as `python -m bench.X`). It imports the library and its layers, never `tests` or
`bench`, and neither of those imports the other. Not here: fixtures (tests/conftest.py), benchmark
logic and result writing (bench/).
"""
