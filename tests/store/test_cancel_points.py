"""Cancellation at every await point of write, append and read, one point after the other.

The context's operations reach storage only through actor messages: ``Actor.send`` (claims,
transfers) and ``Reply.wait`` (their answers). A hook before and after each of those counts the
await points the victim's tasks pass (a context variable marks them; the K and V child tasks
inherit it). A clean run counts ``N``; then for each ``k`` in ``1..N`` the operation is run
again and its cancel scope fires at the ``k``-th point, so the cancellation lands before a
send, while a transfer is in flight, or after an answer arrived.

Afterwards: the cancelled context is consistent (a write either completed or the layer refuses
with :class:`LayerLostError`; an append landed whole or not at all; reads are unaffected);
another context, busy all along, reads back exactly what it wrote; a context that reuses the
victim's freed storage is not overwritten by anything the victim left running; nothing is left
in flight, and no request of the victim is still running in an actor when its cancelled
operation returns.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from dualblade.actors._base import Actor, Reply
from dualblade.store import KVContext, KVStore, LayerLostError, open_store

from .conftest import MakeConfig, random_kv

pytestmark = pytest.mark.anyio

_victim: contextvars.ContextVar[bool] = contextvars.ContextVar("victim", default=False)


class CancelPoints:
    """Counts await points of the victim's tasks; cancels ``scope`` at the ``fire_at``-th."""

    def __init__(self) -> None:
        self.count = 0
        self.fire_at: int | None = None
        self.scope: anyio.CancelScope | None = None
        self.replies: list[Reply[Any]] = []  # replies of requests the victim delivered

    def hit(self) -> None:
        if not _victim.get():
            return
        self.count += 1
        if self.count == self.fire_at and self.scope is not None:
            self.scope.cancel()

    async def run(self, fire_at: int | None, op: Callable[[], Awaitable[Any]]) -> bool:
        """Run ``op`` as the victim; True if the cancellation cut it short."""
        self.count, self.fire_at = 0, fire_at
        self.replies.clear()
        token = _victim.set(True)
        try:
            with anyio.CancelScope() as scope:
                self.scope = scope
                await op()
        finally:
            _victim.reset(token)
            self.scope = None
        return scope.cancelled_caught


@pytest.fixture
def points(monkeypatch: pytest.MonkeyPatch) -> CancelPoints:
    points = CancelPoints()
    send, wait = Actor.send, Reply.wait

    async def hooked_send(self: Actor[Any], message: Any) -> None:
        points.hit()
        await send(self, message)
        reply = getattr(message, "reply", None)
        if _victim.get() and isinstance(reply, Reply):
            points.replies.append(reply)  # delivered: the actor will work on it
        points.hit()

    async def hooked_wait(self: Reply[Any]) -> Any:
        points.hit()
        value = await wait(self)
        points.hit()
        return value

    monkeypatch.setattr(Actor, "send", hooked_send)
    monkeypatch.setattr(Reply, "wait", hooked_wait)
    return points


ROWS = 16


@asynccontextmanager
async def _busy_neighbour(
    store: KVStore,
) -> AsyncIterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """A context that keeps rewriting and checking its layers while the test runs."""
    config = store.config
    data = {layer: random_kv(config, ROWS, seed=100 + layer) for layer in range(4)}
    mismatches: list[int] = []
    async with store.context() as ctx, anyio.create_task_group() as tg:
        for layer, (k, v) in data.items():
            await ctx.write(layer, k, v)

        async def churn() -> None:
            while True:
                for layer, (k, v) in data.items():
                    got_k, got_v = await ctx.read(layer)
                    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
                        mismatches.append(layer)
                    await ctx.write(layer, k, v)

        tg.start_soon(churn)
        yield data
        tg.cancel_scope.cancel()
    assert not mismatches
    # After the churn was cancelled mid-operation its context was closed; data was checked.


async def _check_reuse(store: KVStore) -> None:
    """A new context (it gets the victim's freed run) keeps exactly what it writes."""
    async with store.context() as fresh:
        kv = {layer: random_kv(fresh.store.config, ROWS, seed=200 + layer) for layer in range(4)}
        for layer, (k, v) in kv.items():
            await fresh.write(layer, k, v)
        await anyio.sleep(0.005)  # room for a stray transfer of the victim to land
        for layer, (k, v) in kv.items():
            got_k, got_v = await fresh.read(layer)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)


def _assert_nothing_in_flight(store: KVStore) -> None:
    for buffer in store.runtime.buffers:
        assert buffer.inflight == 0


async def _victim_ops(ctx: KVContext, op: str) -> tuple[Callable[[], Awaitable[Any]], Any]:
    """Prepare ``ctx`` and return the operation to cancel and what it would store."""
    config = ctx.store.config
    old = random_kv(config, ROWS, seed=1)
    await ctx.write(0, *old)
    if op == "write":
        new = random_kv(config, ROWS, seed=2)
        return (lambda: ctx.write(0, *new)), (old, new)
    if op == "append":
        k_row, v_row = random_kv(config, 1, seed=3)
        return (lambda: ctx.append(0, k_row[0], v_row[0])), (old, (k_row, v_row))
    return (lambda: ctx.read(0)), (old, old)


async def _check_victim(ctx: KVContext, op: str, cut: bool, expected: Any) -> None:
    old, new = expected
    if op == "write":
        if cut:
            with pytest.raises(LayerLostError):
                await ctx.read(0)
            with pytest.raises(LayerLostError):
                await ctx.append(0, new[0][0], new[1][0])
            await ctx.write(0, *new)  # writing the layer again heals it
        k, v = await ctx.read(0)
        assert torch.equal(k, new[0])
        assert torch.equal(v, new[1])
    elif op == "append":
        k, v = await ctx.read(0)
        if ctx.length(0) == ROWS + 1:
            assert torch.equal(k, torch.cat([old[0], new[0]]))
            assert torch.equal(v, torch.cat([old[1], new[1]]))
        else:
            assert ctx.length(0) == ROWS
            assert cut, "an append that was not cancelled must land"
            assert torch.equal(k, old[0])
            assert torch.equal(v, old[1])
    else:
        k, v = await ctx.read(0)
        assert torch.equal(k, old[0])
        assert torch.equal(v, old[1])


@pytest.mark.parametrize(
    ("policy", "compat"),
    [("direct", "off"), ("dual", "off"), ("baseline", "off"), ("direct", "on")],
)
@pytest.mark.parametrize("op", ["write", "append", "read"])
async def test_cancel_at_every_await_point(
    make_config: MakeConfig,
    points: CancelPoints,
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
    compat: str,
    op: str,
) -> None:
    monkeypatch.setenv("DUALBLADE_COMPAT", compat)  # the ring, or the thread-pool engine
    config = make_config(policy, prompt_len=ROWS, max_new_tokens=2)
    async with open_store(config, device="cpu") as store:
        async with store.context() as ctx:
            run, _ = await _victim_ops(ctx, op)
            assert not await points.run(None, run)
            total = points.count
        assert total >= 4  # at least a send and an answer for each of K and V
        cuts = 0
        async with _busy_neighbour(store):
            for k in range(1, total + 1):
                async with store.context() as ctx:
                    run, expected = await _victim_ops(ctx, op)
                    cut = await points.run(k, run)
                    cuts += cut
                    # Whatever the victim asked of an actor is over by the time it returns:
                    # nothing of it can still write into storage the context gives back.
                    assert all(reply.done for reply in points.replies)
                    await _check_victim(ctx, op, cut, expected)
                await _check_reuse(store)
        assert cuts >= total // 2  # most points really cut the operation short
        _assert_nothing_in_flight(store)
