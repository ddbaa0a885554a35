"""Boxes (manifest format 3): the chunk rule cuts a piece into sub-boxes that hold its elements in
order, a box chunk is gathered and scattered bit-exactly through its strided view, and the exact-
cover check finds every hole and overlap (docs/format.md, "Boxes")."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.format.boxes import Box, box_view, cover_error
from weightsync.format.chunking import box_chunks, cut_box
from weightsync.format.manifest import ChunkRef, TensorEntry
from weightsync.format.regions import read_region, writable_region


@st.composite
def boxes_in_shapes(draw):
    dims = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(dims))
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets, strict=True))
    return shape, Box(offsets, sizes)


def _indices(shape, box: Box) -> np.ndarray:
    """The flat global indices of a box's elements, in its row-major order."""
    grid = np.arange(math.prod(shape)).reshape(shape)
    return grid[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))].reshape(-1)


@settings(max_examples=300, deadline=None)
@given(boxes_in_shapes(), st.integers(1, 40))
def test_cut_boxes_hold_the_box_elements_in_order_and_fit_a_chunk(shape_box, per_chunk):
    shape, box = shape_box
    parts = cut_box(box, per_chunk)
    assert all(p.numel <= per_chunk and p.fits(shape) for p in parts)
    assert np.array_equal(np.concatenate([_indices(shape, p) for p in parts]), _indices(shape, box))
    assert (
        cover_error(
            box.sizes, [Box(tuple(o - b for o, b in zip(p.offsets, box.offsets, strict=True)), p.sizes) for p in parts]
        )
        is None
    )


def test_a_pieces_chunks_run_through_its_local_elements_box_after_box():
    chunks = box_chunks([Box((0, 4), (3, 10)), Box((5, 0), (1, 2))], itemsize=2, chunk_bytes=16)
    assert [(start, stop) for start, stop, _ in chunks] == [
        (0, 5),
        (5, 10),
        (10, 15),
        (15, 20),
        (20, 25),
        (25, 30),
        (30, 32),
    ]
    assert chunks[1][2] == Box((0, 9), (1, 5)) and chunks[-1][2] == Box((5, 0), (1, 2))


@settings(max_examples=200, deadline=None)
@given(boxes_in_shapes(), st.sampled_from([1, 2, 4]))
def test_a_box_chunk_is_read_and_written_in_place_bit_exactly(shape_box, itemsize):
    shape, box = shape_box
    rng = np.random.default_rng(0)
    buffer = rng.integers(0, 256, math.prod(shape) * itemsize, dtype=np.uint8)
    tensor = TensorEntry(name="t", dtype={1: "uint8", 2: "bfloat16", 4: "float32"}[itemsize], shape=shape, chunks=())
    ref = ChunkRef(box=box, codec="full", raw="0" * 32)
    expected = buffer.reshape(-1, itemsize)[_indices(shape, box)].reshape(-1)
    assert np.array_equal(read_region(buffer, tensor, ref), expected)
    new = rng.integers(0, 256, box.numel * itemsize, dtype=np.uint8)
    before = buffer.copy()
    with writable_region(buffer, tensor, ref) as out:
        out[:] = new
    assert np.array_equal(buffer.reshape(-1, itemsize)[_indices(shape, box)].reshape(-1), new)
    outside = np.ones(math.prod(shape), dtype=bool)
    outside[_indices(shape, box)] = False
    assert np.array_equal(buffer.reshape(-1, itemsize)[outside], before.reshape(-1, itemsize)[outside])
    assert box_view(buffer, shape, itemsize, box).shape == (*box.sizes, itemsize)


def test_cover_errors_name_the_box():
    halves = [Box((0, 0), (4, 3)), Box((0, 3), (4, 3))]
    assert cover_error((4, 6), halves) is None
    assert cover_error((4, 6), halves[:1]) == "box(offsets=[0, 3], sizes=[4, 3]) is covered by no chunk (a hole)"
    assert cover_error((4, 6), [*halves, Box((2, 2), (1, 2))], ["rank 0", "rank 1", "rank 2"]) == (
        "box(offsets=[2, 2], sizes=[1, 2]) (rank 2) overlaps box(offsets=[0, 0], sizes=[4, 3]) (rank 0) "
        "(an element covered twice)"
    )
    assert "outside the shape [4, 6]" in cover_error((4, 6), [Box((0, 0), (5, 6))])
    assert cover_error((0, 6), []) is None and cover_error((), [Box((), ())]) is None
