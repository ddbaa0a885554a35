#!/usr/bin/env bash
# Regenerates the committed gRPC/protobuf code in weightsync/v1/ from proto/weightsync/v1/*.proto.
# Uses the grpcio-tools pinned in pyproject.toml (test extra); tests/test_proto.py fails if the
# committed files differ from what this produces.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
"$python" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/weightsync/v1/*.proto
