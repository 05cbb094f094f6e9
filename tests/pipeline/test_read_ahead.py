"""The read order of a decode step: every layer once, buffers never over-held, no deadlock,
and slow layers no later than in layer order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.pipeline import Medium, ReadAhead, decode_read_buffers


def _walk(order: ReadAhead) -> list[tuple[int, int]]:
    """Use every layer in order as its read is issued; returns the issue sequence."""
    issued = order.start()
    held = {layer: buffer for layer, buffer in issued}
    for layer in range(order.num_layers):
        # The layer needed next is always issued already: the walk never waits on a buffer.
        assert layer in held, f"layer {layer} needed but not read (held: {held})"
        assert len(held) <= order.buffers
        assert len(set(held.values())) == len(held), "two layers in one buffer"
        freed = held.pop(layer)
        following = order.used(layer)
        if following is not None:
            assert following[1] == freed, "the next read goes into the buffer just freed"
            held[following[0]] = following[1]
            issued.append(following)
    assert not held
    return issued


@given(
    layers=st.integers(1, 40),
    buffers=st.integers(1, 6),
    data=st.data(),
)
def test_every_layer_is_read_once_within_the_buffers(layers: int, buffers: int, data) -> None:
    slow = data.draw(st.sets(st.integers(0, layers - 1)))
    issued = _walk(ReadAhead(layers, buffers, slow))
    assert sorted(layer for layer, _ in issued) == list(range(layers))
    assert all(0 <= buffer < buffers for _, buffer in issued)
    # Slow layers start no later than they would in layer order.
    position = {layer: i for i, (layer, _) in enumerate(issued)}
    assert all(position[layer] <= layer for layer in slow)


@given(layers=st.integers(1, 30), buffers=st.integers(1, 5))
def test_without_slow_layers_it_is_layer_order(layers: int, buffers: int) -> None:
    issued = _walk(ReadAhead(layers, buffers))
    assert [layer for layer, _ in issued] == list(range(layers))
    assert [buffer for _, buffer in issued] == [layer % buffers for layer in range(layers)]


def test_a_slow_layer_is_read_as_soon_as_a_buffer_is_spare() -> None:
    # Two buffers, direct layers 3 and 6: while 0, 1, 2 take turns in one buffer, the disk is
    # already reading 3; 6 goes as soon as 3 is no longer ahead of the order.
    order = [layer for layer, _ in _walk(ReadAhead(8, 2, [3, 6]))]
    assert order == [0, 3, 1, 2, 6, 4, 5, 7]


def test_one_buffer_never_reads_ahead() -> None:
    assert [layer for layer, _ in _walk(ReadAhead(5, 1, [2, 4]))] == [0, 1, 2, 3, 4]


def test_a_contexts_media_name_its_slow_layers() -> None:
    media = [Medium.PAGE_CACHE, Medium.DIRECT, Medium.PAGE_CACHE_DROPPED, Medium.DIRECT]
    order = ReadAhead.for_media(media, 2)
    assert (order.num_layers, order.buffers) == (4, 2)
    assert [layer for layer, _ in _walk(order)] == [0, 1, 3, 2]


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="needs layers and buffers"):
        ReadAhead(0, 2)
    with pytest.raises(ValueError, match="outside"):
        ReadAhead(4, 2, [4])
    order = ReadAhead(4, 2)
    order.start()
    with pytest.raises(ValueError, match="out of order"):
        order.used(1)


def _most_slow_layers_held(order: ReadAhead, slow: set[int]) -> int:
    """The most slow layers held at once (read or being read, not yet used) over a walk."""
    held = dict(order.start())
    most = 0
    for layer in range(order.num_layers):
        most = max(most, len(slow & held.keys()))
        held.pop(layer)
        following = order.used(layer)
        if following is not None:
            held[following[0]] = following[1]
    return most


@pytest.mark.parametrize("read_parallelism", [1, 2, 4])
def test_the_decodes_extra_buffer_holds_one_more_direct_layer(read_parallelism: int) -> None:
    # A direct layer, then three page-cache layers: while the walk uses those one buffer at a
    # time, a landed direct layer holds another, and only a spare one lets the disk go on.
    slow = set(range(0, 32, 4))
    buffers = decode_read_buffers(read_parallelism)
    assert buffers == read_parallelism + 1
    with_spare = _most_slow_layers_held(ReadAhead(32, buffers, slow), slow)
    without = _most_slow_layers_held(ReadAhead(32, read_parallelism, slow), slow)
    assert with_spare == without + 1


def test_two_steps_joined_read_the_next_steps_direct_layer_ahead_of_this_steps_last() -> None:
    # Layers 1 and 3 are direct in both steps, and the next step's first two reads are 0 and
    # 1. Joined, the next step's 1 (here 5) takes the first buffer freed once this step's 3
    # is asked for: ahead of this step's 2, and of the next step's 0 (here 4). The next
    # step's 3 (here 7) is left to it.
    media = [Medium.PAGE_CACHE, Medium.DIRECT] * 2
    step = ReadAhead.for_media(media, 3)
    joined = step.then(ReadAhead.for_media(media, 3), carry=2)
    assert joined.num_layers == 8
    assert joined.slow_layers == (1, 3, 5, 7)
    issued = joined.start()
    for layer in range(4):  # this step's layers only: the rest are the next step's
        following = joined.used(layer)
        if following is not None:
            issued.append(following)
    assert [layer for layer, _ in issued] == [0, 1, 3, 5, 2, 4]


def test_orders_are_joined_only_when_fresh_of_one_buffer_count_and_a_carry_that_fits() -> None:
    with pytest.raises(ValueError, match="buffers differ"):
        ReadAhead(4, 2).then(ReadAhead(4, 3), carry=1)
    started = ReadAhead(4, 2)
    started.start()
    with pytest.raises(ValueError, match="before either"):
        started.then(ReadAhead(4, 2), carry=1)
    adopted = ReadAhead(4, 2)
    adopted.adopt(0, 0)
    with pytest.raises(ValueError, match="before either"):
        ReadAhead(4, 2).then(adopted, carry=1)
    with pytest.raises(ValueError, match="0 to 2 layers"):
        ReadAhead(4, 2).then(ReadAhead(4, 2), carry=3)
