"""Algorithm 2: slices become chunks that cover exactly their rows, never a neighbour's bytes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualblade.pipeline import (
    KpuId,
    LbaMap,
    PlanError,
    Region,
    RowRange,
    TensorLayout,
    get_preset,
    layer_kpus,
    plan_slice,
)


def _one(layout, first_lba=0):
    lba_map = LbaMap.bind(
        [(KpuId(0, "K"), layout.image_bytes)], Region(first_lba, layout.n_blocks), layout.lba_size
    )
    return lba_map.lookup(KpuId(0, "K"))


def test_opt_6_7b_decode_append_and_prefix():
    layout = TensorLayout.for_shape(get_preset("opt-6.7b"), 32, 544, 4096)
    assert (layout.row_stride, layout.blocks_per_row, layout.padding_overhead) == (262144, 64, 0.0)
    extent = _one(layout, first_lba=1000)
    # The paper's 256 KiB decode write: row t is one 64-block command.
    append = plan_slice(extent, layout, RowRange.row(512), 1 << 20)
    assert [(c.slba, c.nlb, c.buffer_offset, c.nbytes) for c in append.chunks] == [
        (1000 + 512 * 64, 64, 0, 262144)
    ]
    assert append.image_offset == 512 * 262144
    prefix = plan_slice(extent, layout, RowRange.prefix(10), 1 << 20)
    # 10 rows = 2.5 MiB: two 1 MiB chunks and a half one.
    assert [(c.slba, c.nlb, c.buffer_offset) for c in prefix.chunks] == [
        (1000, 256, 0),
        (1256, 256, 1 << 20),
        (1512, 128, 2 << 20),
    ]
    assert prefix.file_ranges()[1] == (1256 * 4096, 1 << 20, 1 << 20)


def test_opt_13b_batch_one_is_padded():
    layout = TensorLayout.for_shape(get_preset("opt-13b"), 1, 8, 4096)
    assert (layout.row_bytes, layout.row_stride, layout.padding_per_row) == (10240, 12288, 2048)
    assert layout.padding_overhead == pytest.approx(0.2)
    plan = plan_slice(_one(layout), layout, RowRange.row(3), 4096)
    assert [(c.slba, c.nlb) for c in plan.chunks] == [(9, 1), (10, 1), (11, 1)]
    assert (plan.payload_bytes, plan.buffer_bytes) == (10240, 12288)


def test_empty_slice_and_refusals():
    layout = TensorLayout(rows=4, row_bytes=512, lba_size=512)
    extent = _one(layout)
    assert plan_slice(extent, layout, RowRange(2, 2), 512).chunks == ()
    with pytest.raises(PlanError, match="run past"):
        plan_slice(extent, layout, RowRange(3, 5), 512)
    with pytest.raises(PlanError, match="multiple of the LBA size"):
        plan_slice(extent, layout, RowRange(0, 1), 768)
    with pytest.raises(PlanError, match="does not match"):
        plan_slice(extent, TensorLayout(rows=5, row_bytes=512, lba_size=512), RowRange(0, 1), 512)
    with pytest.raises(PlanError, match="not a range"):
        RowRange(3, 2)


layouts = st.builds(
    TensorLayout,
    rows=st.integers(1, 300),
    row_bytes=st.integers(1, 40_000).map(lambda n: n * 2),
    lba_size=st.sampled_from([512, 4096]),
)


@st.composite
def slice_cases(draw):
    layout = draw(layouts)
    a = draw(st.integers(0, layout.rows))
    b = draw(st.integers(a, layout.rows))
    max_transfer = layout.lba_size * draw(st.integers(1, 64))
    first_lba = draw(st.integers(0, 1 << 32))
    return layout, RowRange(a, b), max_transfer, first_lba


@given(slice_cases())
def test_chunks_cover_exactly_the_rows(case):
    layout, rows, max_transfer, first_lba = case
    extent = _one(layout, first_lba)
    plan = plan_slice(extent, layout, rows, max_transfer)
    lba = layout.lba_size
    start = extent.lba_start + rows.start * layout.row_stride // lba
    stop = extent.lba_start + rows.stop * layout.row_stride // lba
    cursor, offset = start, 0
    for chunk in plan.chunks:
        assert chunk.slba == cursor
        assert chunk.buffer_offset == offset
        assert 0 < chunk.nbytes <= max_transfer  # never above max transfer
        assert chunk.nbytes == chunk.nlb * lba  # aligned
        assert extent.lba_start <= chunk.slba
        assert chunk.slba + chunk.nlb <= extent.end
        cursor += chunk.nlb
        offset += chunk.nbytes
    assert cursor == stop  # exactly the requested rows, nothing of the next row
    assert offset == plan.buffer_bytes == len(rows) * layout.row_stride


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 9),
    kv_width=st.sampled_from([40, 64, 320, 768]),
    rows=st.integers(1, 12),
    max_transfer_blocks=st.integers(1, 5),
)
def test_simulated_device_never_touches_a_neighbour(batch, kv_width, rows, max_transfer_blocks):
    """Write every row of every KPU by single-row appends, then read prefixes back."""
    lba = 512
    row_bytes = batch * kv_width * 2
    layout = TensorLayout(rows=rows, row_bytes=row_bytes, lba_size=lba)
    kpus = layer_kpus([0, 1])
    lba_map = LbaMap.bind(
        [(k, layout.image_bytes) for k in kpus], Region(3, 4 * layout.n_blocks), lba
    )
    device = bytearray(b"\xee" * (lba_map.region.end * lba))
    max_transfer = max_transfer_blocks * lba

    def pattern(kpu, t):
        return bytes([(kpu.layer * 31 + ord(kpu.tensor) + t) % 251]) * row_bytes

    for t in range(rows):  # decode-style interleaving of appends across KPUs
        for kpu in kpus:
            plan = plan_slice(lba_map.lookup(kpu), layout, RowRange.row(t), max_transfer)
            buffer = pattern(kpu, t).ljust(plan.buffer_bytes, b"\0")
            for chunk in plan.chunks:
                offset = chunk.file_offset(lba)
                device[offset : offset + chunk.nbytes] = buffer[
                    chunk.buffer_offset : chunk.buffer_offset + chunk.nbytes
                ]
    assert device[: 3 * lba] == b"\xee" * 3 * lba  # nothing before the region was written
    for kpu in kpus:
        plan = plan_slice(lba_map.lookup(kpu), layout, RowRange.prefix(rows), max_transfer)
        buffer = bytearray(plan.buffer_bytes)
        for chunk in plan.chunks:
            offset = chunk.file_offset(lba)
            buffer[chunk.buffer_offset : chunk.buffer_offset + chunk.nbytes] = device[
                offset : offset + chunk.nbytes
            ]
        for t in range(rows):
            row = buffer[t * layout.row_stride : t * layout.row_stride + row_bytes]
            assert row == pattern(kpu, t)
