#!/usr/bin/env bash
# Regenerates the committed protobuf code in weightsync/transport/v1/ from
# proto/weightsync/transport/v1/*.proto (the proto path mirrors the Python package; the wire package
# stays `weightsync.v1`). Uses the grpcio-tools pinned in pyproject.toml (test extra);
# tests/transport/test_proto.py fails if the committed files differ from what this produces. No gRPC
# stubs are generated: the agent registers its handlers itself (weightsync/transport/rpc.py).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
"$python" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. proto/weightsync/transport/v1/*.proto
