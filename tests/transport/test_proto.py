"""The generated gRPC code in weightsync/transport/v1/ is current: regenerating it from proto/ with the pinned
grpcio-tools (scripts/gen_proto.sh does the same) gives the committed bytes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ["sync_pb2.py", "sync_pb2.pyi"]


def test_generated_code_is_current(tmp_path):
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            "--python_out=.",
            "--pyi_out=.",
            "proto/weightsync/transport/v1/sync.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "weightsync" / "transport" / "v1" / name).read_bytes()
        committed = (ROOT / "weightsync" / "transport" / "v1" / name).read_bytes()
        assert fresh == committed, (
            f"weightsync/transport/v1/{name} is stale: run scripts/gen_proto.sh and commit the result"
        )


def test_the_hand_encoded_frame_is_the_proto_message():
    from weightsync.transport.rpc import ObjectFrame, decode_object_frame, encode_object_frame
    from weightsync.transport.v1 import sync_pb2

    frame = ObjectFrame("org/model", 2**40 + 3, "ab" * 16, bytes(range(256)) * 300)
    parsed = sync_pb2.ObjectFrame.FromString(encode_object_frame(frame))
    assert (parsed.model, parsed.version, parsed.object, parsed.data) == (
        frame.model,
        frame.version,
        frame.object,
        frame.data,
    )
    back = decode_object_frame(
        sync_pb2.ObjectFrame(model="m", version=7, object="c" * 32, data=b"xyz").SerializeToString()
    )
    assert (back.model, back.version, back.object, bytes(back.data)) == ("m", 7, "c" * 32, b"xyz")


def test_a_frame_s_placement_crosses_the_wire():
    from weightsync.format.manifest import ChunkPlacement
    from weightsync.transport.rpc import ObjectFrame, decode_object_frame, encode_object_frame
    from weightsync.transport.v1 import sync_pb2

    where = ChunkPlacement("model.layers.0.mlp.up_proj.weight", 2**21, 2**22, 41)
    frame = ObjectFrame("org/model", 42, "ab" * 16, b"payload", where)
    parsed = sync_pb2.ObjectFrame.FromString(encode_object_frame(frame))
    assert (parsed.tensor, parsed.start, parsed.stop, parsed.parent, parsed.data) == (
        where.tensor,
        where.start,
        where.stop,
        where.parent,
        b"payload",
    )
    assert decode_object_frame(encode_object_frame(frame)).placement == where
    assert decode_object_frame(parsed.SerializeToString()).placement == where
    # A sender that does not know where its objects go (a relay of store fetches, older pushers).
    assert (
        decode_object_frame(
            sync_pb2.ObjectFrame(model="m", version=7, object="c" * 32, data=b"x").SerializeToString()
        ).placement
        is None
    )


@pytest.mark.parametrize(
    "raw",
    [
        # Field 1 (model) as a varint of ~8e9: read as bytes(n), it once allocated 8 GB (found by the RPC fuzzer).
        b"\x08\x80\x80\x80\xec\x1d",
        b"\x12\x01m",  # field 2 (version) length-delimited
        b"\x20\x05",  # field 4 (data) as a varint
        b"\x0a\x01m\x49\x00\x00",  # an unknown fixed64 field (9) cut short
        b"\x0a\x01m\x4d\x00",  # an unknown fixed32 field (9) cut short
        b"\x22\x09abc",  # data longer than the frame
        b"\x0b",  # wire type 3 (groups)
    ],
)
def test_a_malformed_frame_is_a_format_error_and_allocates_nothing_it_names(raw):
    from weightsync.errors import FormatError
    from weightsync.transport.rpc import decode_object_frame

    with pytest.raises(FormatError, match="malformed object frame"):
        decode_object_frame(raw)


def test_unknown_fields_of_any_wire_type_are_skipped_as_protobuf_does():
    from weightsync.transport.rpc import decode_object_frame
    from weightsync.transport.v1 import sync_pb2

    known = sync_pb2.ObjectFrame(model="m", version=7, object="c" * 32, data=b"xyz").SerializeToString()
    unknown = b"\x48\x05" + b"\x51" + b"\x00" * 8 + b"\x5d" + b"\x00" * 4 + b"\x62\x02hi"  # fields 9-12
    back = decode_object_frame(unknown + known)
    assert (back.model, back.version, back.object, bytes(back.data)) == ("m", 7, "c" * 32, b"xyz")
