"""Aligned buffers: alignment, tensor aliasing, and refusal to release under DMA or aliasing."""

from __future__ import annotations

import gc

import pytest
import torch

from dualblade.io_engine import (
    HUGE_PAGE_SIZE,
    PAGE_SIZE,
    AlignedBuffer,
    BorrowedBuffer,
    BufferBusyError,
)


def test_small_buffers_are_page_aligned_and_rounded_up() -> None:
    with AlignedBuffer(5000) as buf:
        assert buf.size == 2 * PAGE_SIZE
        assert buf.address % PAGE_SIZE == 0
        assert not buf.huge


def test_large_buffers_are_huge_page_aligned_where_thp_is_on() -> None:
    with AlignedBuffer(4 << 20) as buf:
        if buf.huge:
            assert buf.address % HUGE_PAGE_SIZE == 0
        else:
            pytest.skip("transparent huge pages are disabled on this machine")


def test_tensor_aliases_the_buffer_without_copy() -> None:
    with AlignedBuffer(1 << 20) as buf:
        t = buf.tensor(torch.float16)
        assert t.numel() == (1 << 20) // 2
        assert t.data_ptr() == buf.address
        t[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float16)
        assert bytes(buf.view[:8]) == t[:4].numpy().tobytes()
        del t


def test_close_refuses_while_a_tensor_aliases_it() -> None:
    buf = AlignedBuffer(1 << 20)
    t = buf.tensor()
    with pytest.raises(BufferError, match="aliases"):
        buf.close()
    assert not buf.closed
    t[0] = 3  # still valid memory
    del t
    buf.close()
    assert buf.closed


def test_a_view_held_only_by_a_reference_cycle_does_not_stop_close() -> None:
    """A task that failed while it held a view leaves the view in its traceback's frame, and
    the frame refers back to the exception: garbage, but alive until the collector runs. Close
    must not call that an alias (a store stopping mid-load failed on it)."""
    buf = AlignedBuffer(1 << 20)

    def hold_and_fail() -> None:
        view = buf.tensor()
        try:
            raise RuntimeError("cancelled")
        except RuntimeError as error:
            cycle = error  # the frame holds the error, the error's traceback holds the frame
            view[0] = 1
            raise cycle from None

    gc.disable()  # keep the cycle until close, as a collector that has not run yet would
    try:
        with pytest.raises(RuntimeError):
            hold_and_fail()
        buf.close()
    finally:
        gc.enable()
    assert buf.closed


def test_an_error_leaving_the_block_is_not_hidden_by_an_alias() -> None:
    """The error that ends a ``with`` block comes out as itself, even where something still
    aliases the buffer (a failed assertion's frame keeps its operands): the buffer stays mapped
    and can be closed once the alias goes."""
    buf = AlignedBuffer(1 << 20)
    aliases: list[memoryview] = []

    def fail_inside() -> None:
        with buf:
            aliases.append(buf.view[:16])
            raise ValueError("the block's own error")

    with pytest.raises(ValueError, match="the block's own error"):
        fail_inside()
    assert not buf.closed
    aliases[0][0] = 1  # still valid memory
    aliases.pop().release()
    buf.close()
    assert buf.closed


def test_close_refuses_while_io_is_in_flight() -> None:
    buf = AlignedBuffer(1 << 20)
    buf.begin_io()
    with pytest.raises(BufferBusyError, match="in flight"):
        buf.close()
    buf.end_io()
    buf.close()
    with pytest.raises(BufferBusyError, match="closed"):
        buf.begin_io()


def test_bad_size() -> None:
    with pytest.raises(ValueError, match="positive"):
        AlignedBuffer(0)


def test_pin_for_cuda_is_a_no_op_without_cuda() -> None:
    with AlignedBuffer(1 << 20) as buf:
        assert buf.pin_for_cuda() is torch.cuda.is_available()


def test_a_borrowed_buffer_is_the_tensors_own_memory() -> None:
    owner = torch.arange(64, dtype=torch.int32)
    borrowed = BorrowedBuffer(owner)
    assert borrowed.address == owner.data_ptr()
    assert borrowed.size == 256
    borrowed.view[0:4] = (7).to_bytes(4, "little")
    assert int(owner[0]) == 7  # the engine's writes land in the caller's tensor
    assert not borrowed.pin_for_cuda()  # the caller's memory is the caller's to pin


def test_a_borrowed_buffer_is_not_released_under_io() -> None:
    borrowed = BorrowedBuffer(torch.zeros(4096, dtype=torch.uint8))
    borrowed.begin_io()
    with pytest.raises(BufferBusyError, match="in flight"):
        borrowed.close()
    borrowed.end_io()
    borrowed.close()
    assert borrowed.closed


@pytest.mark.parametrize(
    "tensor",
    [torch.zeros(0), torch.zeros(8, 8)[:, 0], torch.zeros(4, device="meta")],
    ids=["empty", "strided", "not-on-the-cpu"],
)
def test_a_borrowed_buffer_needs_contiguous_cpu_memory(tensor: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        BorrowedBuffer(tensor)


def test_a_borrowed_buffer_may_take_a_prefix_of_its_tensor() -> None:
    owner = torch.zeros(1024, dtype=torch.uint8)
    borrowed = BorrowedBuffer(owner, 100)
    assert (borrowed.address, borrowed.size, len(borrowed.view)) == (owner.data_ptr(), 100, 100)
    for nbytes in (0, 1025):
        with pytest.raises(ValueError, match="1024-byte tensor"):
            BorrowedBuffer(owner, nbytes)
