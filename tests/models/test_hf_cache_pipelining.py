"""The transformers cache's write-behind holds back a prefill as the OPT engine's does."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from dualblade.models.hf_cache._pipelining import WRITES_BEHIND, LayerPipeline


def _in_thread(call: Any) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_a_layer_write_past_the_bound_waits_for_the_oldest() -> None:
    """Two whole-layer writes go behind the compute; the third waits until the first lands,
    so a prefill never holds more than two layers' K and V waiting for storage."""
    assert WRITES_BEHIND == 2
    pipeline = LayerPipeline(depth=2)
    first, second, third = Future[None](), Future[None](), Future[None]()
    pipeline.write_behind(0, first, whole_layer=True)
    pipeline.write_behind(1, second, whole_layer=True)  # two in flight: no wait
    waiting = _in_thread(lambda: pipeline.write_behind(2, third, whole_layer=True))
    waiting.join(0.3)
    assert waiting.is_alive(), "the third layer's write did not wait for the first"
    first.set_result(None)
    waiting.join(10)
    assert not waiting.is_alive()
    # now two (the second and third) are in flight: a fourth waits for the second
    fourth = Future[None]()
    waiting = _in_thread(lambda: pipeline.write_behind(3, fourth, whole_layer=True))
    waiting.join(0.3)
    assert waiting.is_alive()
    second.set_result(None)
    waiting.join(10)
    assert not waiting.is_alive()


def test_appends_do_not_wait() -> None:
    """A decode step's one-row appends are bounded by the step itself (each is settled at
    its layer's next read), so they never wait here."""
    pipeline = LayerPipeline(depth=2)
    pending = [Future[None]() for _ in range(8)]
    for layer, future in enumerate(pending):
        pipeline.write_behind(layer, future)  # would hang if appends were held back


def test_a_failed_write_that_was_waited_for_is_raised_at_its_layers_next_update() -> None:
    """Waiting for the oldest write does not swallow its error: it is raised where every
    write's is, before the layer's rows could be misread."""
    pipeline = LayerPipeline(depth=2)
    failed = Future[None]()
    failed.set_exception(OSError("EIO"))
    pipeline.write_behind(0, failed, whole_layer=True)
    for layer in (1, 2):
        landed = Future[None]()
        landed.set_result(None)
        pipeline.write_behind(layer, landed, whole_layer=True)  # waits on the failed one
    with pytest.raises(OSError, match="EIO"):
        pipeline.raise_failed_writes(0)
    pipeline.raise_failed_writes(1)  # the others landed
