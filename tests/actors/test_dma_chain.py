"""``GpuDmaActor.chain``: a load's copy queued by the engine's thread as the read ends.

No GPU here: the actor runs on a fake ``libcuda`` (``fake_cuda``) whose copies move host bytes,
with a real :class:`DmaCompletions` thread answering on the loop. What is checked: the copy
waits for the caller's stream as recorded when the load was asked, runs on the DMA stream with
the context made current on the launching thread, answers on the loop with the bytes moved, and
gives both events back; a failed read, a stopping actor and a failed driver call each fail the
requester's reply (never a copy after stop, never a lost answer).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable

import anyio
import pytest
import torch

from dualblade.actors import ActorStoppedError
from dualblade.actors._base import Reply
from dualblade.actors.gpu_dma import Copy, GpuDmaActor
from dualblade.io_engine import IOFailedError

from .fake_cuda import CALLER_STREAM, DMA_STREAM, FakeLibrary, fake_cuda_dma

pytestmark = pytest.mark.anyio


@pytest.fixture
async def dma() -> AsyncIterator[tuple[GpuDmaActor, FakeLibrary]]:
    actor = GpuDmaActor(torch.device("cpu"))
    held = fake_cuda_dma(actor)
    try:
        yield actor, held
    finally:
        await actor.on_stop()
        actor.close()


def _copy(nbytes: int = 1 << 16) -> tuple[Copy, Reply[int]]:
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    reply: Reply[int] = Reply()
    return Copy(source, torch.zeros_like(source), "h2d", "L0.K", reply), reply


def _chained(actor: GpuDmaActor) -> tuple[Copy, Reply[int], Callable[[BaseException | None], None]]:
    """A copy asked for as a chained launch (on the loop), with its reply and the launch."""
    copy, reply = _copy()
    launch = actor.chain(copy)
    assert launch is not None
    return copy, reply, launch


def _on_thread(function: object, *args: object) -> str:
    """Run ``function(*args)`` on a thread of its own, as the engine's thread would."""
    thread = threading.Thread(target=function, args=args, name="engine")  # type: ignore[arg-type]
    thread.start()
    thread.join()
    return thread.name


async def test_a_chained_copy_runs_after_the_caller_stream_and_answers_on_the_loop(dma):
    actor, held = dma
    copy, reply, launch = _chained(actor)
    (name, thread, (ready, stream)) = held.calls[-1]  # recorded on the loop, at chain time
    assert (name, stream) == ("cuEventRecord", CALLER_STREAM)
    assert thread == threading.current_thread().name
    held.calls.clear()
    _on_thread(launch, None)
    with anyio.fail_after(5):
        assert await reply.wait() == copy.source.numel()
    assert torch.equal(copy.destination, copy.source)
    launched = [(name, args) for name, thread, args in held.calls if thread == "engine"]
    assert [name for name, _ in launched] == [
        "cuCtxGetCurrent",
        "cuCtxSetCurrent",  # the engine's thread had no context current
        "cuStreamWaitEvent",
        "cuMemcpyHtoDAsync_v2",
        "cuEventCreate",
        "cuEventRecord",
    ]
    assert launched[2][1][:2] == (DMA_STREAM, ready)  # the DMA stream waits for the caller's
    assert launched[-1][1][1] == DMA_STREAM
    assert (actor.chained_copies, actor.driver_copies, actor.bytes_h2d) == (1, 1, 1 << 16)
    # both events went back to the pool: the next chained copy creates none
    held.calls.clear()
    _, again, launch = _chained(actor)
    _on_thread(launch, None)
    with anyio.fail_after(5):
        await again.wait()
    assert "cuEventCreate" not in held.names()


async def test_a_failed_read_fails_the_reply_and_queues_no_copy(dma):
    actor, held = dma
    _, reply, launch = _chained(actor)
    error = IOFailedError("direct.dat", "read", 0, 4096, errno=5)
    _on_thread(launch, error)
    with anyio.fail_after(5), pytest.raises(IOFailedError) as caught:
        await reply.wait()
    assert caught.value is error
    assert "cuMemcpyHtoDAsync_v2" not in held.names()
    assert actor.chained_copies == 0
    assert len(actor._free_events) == 1  # the ready event came back


async def test_no_copy_starts_once_the_actor_is_stopping(dma):
    actor, held = dma
    _, reply, launch = _chained(actor)
    await actor.on_stop()  # waits for queued copies, then takes no more
    _on_thread(launch, None)
    with anyio.fail_after(5), pytest.raises(ActorStoppedError, match="stopping"):
        await reply.wait()
    assert "cuMemcpyHtoDAsync_v2" not in held.names()


async def test_a_failed_driver_call_fails_the_reply_and_later_copies(dma):
    actor, held = dma
    _, reply, launch = _chained(actor)
    held.codes["cuMemcpyHtoDAsync_v2"] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    _on_thread(launch, None)
    with anyio.fail_after(5), pytest.raises(ActorStoppedError, match="cuMemcpyHtoDAsync"):
        await reply.wait()
    with pytest.raises(ActorStoppedError, match="an earlier copy failed"):
        actor.chain(_copy()[0])


async def test_a_copy_that_cannot_go_through_the_driver_is_not_chained(dma):
    actor, _ = dma
    source = torch.zeros(64, 64, dtype=torch.uint8)[:, :32]  # rows with gaps
    reply: Reply[int] = Reply()
    assert (
        actor.chain(Copy(source, torch.zeros(64, 32, dtype=torch.uint8), "h2d", "x", reply)) is None
    )
