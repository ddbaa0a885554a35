"""harness: what tests and benchmarks both run against — real servers, proxies, fakes.

Not installed with weightsync; importable from the repository root (pytest's `pythonpath`,
`python -m bench.X`). Not here: assertions (tests/), measurements (bench/).
"""
