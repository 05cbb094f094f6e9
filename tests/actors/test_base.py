"""The actor base: readiness, ordering, backpressure, error routing, shutdown."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import pytest

from dualblade.actors import Actor, ActorStoppedError, Reply
from dualblade.errors import DualbladeError

pytestmark = pytest.mark.anyio


class RefusedError(DualbladeError):
    """An expected, per-request failure."""


@dataclass(frozen=True)
class Msg:
    value: object
    reply: Reply[object] | None = None
    gate: anyio.Event | None = field(default=None, compare=False)


class Recorder(Actor[Msg]):
    """Records what it handled; ``"refuse"`` raises a DualbladeError, ``"boom"`` a bug."""

    def __init__(self, mailbox_size: int = 4) -> None:
        super().__init__("recorder", mailbox_size=mailbox_size)
        self.seen: list[object] = []
        self.started = False
        self.stopped = False
        self.handling = anyio.Event()

    async def on_start(self) -> None:
        await anyio.lowlevel.checkpoint()  # start-up work that yields to the loop
        self.started = True

    async def on_stop(self) -> None:
        await anyio.lowlevel.checkpoint()
        self.stopped = True

    async def handle(self, message: Msg) -> None:
        self.handling.set()
        if message.gate is not None:
            await message.gate.wait()
        if message.value == "refuse":
            raise RefusedError("no such thing")
        if message.value == "boom":
            raise RuntimeError("a bug in the actor")
        self.seen.append(message.value)
        if message.reply is not None:
            message.reply.set(("done", message.value))


@pytest.fixture
def recorder():
    """A factory of recorders, all closed at teardown (a dead actor's mailbox stays open)."""
    made: list[Recorder] = []

    def make(mailbox_size: int = 4) -> Recorder:
        made.append(Recorder(mailbox_size))
        return made[-1]

    yield make
    for actor in made:
        actor.close()


def leaves(group: BaseException) -> list[BaseException]:
    """The non-group exceptions inside (possibly nested) exception groups."""
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in leaves(inner)]
    return [group]


async def test_readiness_after_start_up_work(recorder):
    actor = recorder()
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        assert actor.started  # tg.start returned only after on_start finished
        assert not actor.stopped
        actor.close()
    assert actor.stopped


async def test_messages_handled_in_order(recorder):
    actor = recorder()
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        for i in range(20):
            await actor.send(Msg(i))
        reply: Reply[object] = Reply()
        assert await actor.ask(Msg("last", reply), reply) == ("done", "last")
        actor.close()
    assert actor.seen == [*range(20), "last"]
    assert actor.handled == 21


async def test_small_mailbox_blocks_sender_while_full(recorder):
    actor = recorder(mailbox_size=1)
    gate = anyio.Event()
    sent: list[int] = []

    async def sender() -> None:
        for i in range(3):
            await actor.send(Msg(i, gate=gate if i == 0 else None))
            sent.append(i)

    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        tg.start_soon(sender)
        await anyio.wait_all_tasks_blocked()
        # Message 0 is in handle (waiting on the gate), message 1 fills the one-slot mailbox,
        # so the sender is stuck on message 2.
        assert actor.handling.is_set()
        assert sent == [0, 1]
        assert actor.seen == []
        gate.set()
        await anyio.wait_all_tasks_blocked()
        assert sent == [0, 1, 2]
        assert actor.seen == [0, 1, 2]
        actor.close()


async def test_dualblade_error_fails_only_that_request(recorder):
    actor = recorder()
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        bad: Reply[object] = Reply()
        with pytest.raises(RefusedError, match="no such thing"):
            await actor.ask(Msg("refuse", bad), bad)
        assert bad.done
        good: Reply[object] = Reply()
        assert await actor.ask(Msg("after", good), good) == ("done", "after")
        actor.close()
    assert actor.seen == ["after"]


async def own(actor: Recorder, message: Msg, *others) -> None:
    """Run ``actor`` (and ``others``) in a task group, send ``message``, wait for the end."""
    async with anyio.create_task_group() as tg:
        for other in others:
            tg.start_soon(other)
        await tg.start(actor.run)
        await actor.send(message)
        await anyio.sleep_forever()


async def test_dualblade_error_without_reply_propagates(recorder):
    actor = recorder()
    with pytest.raises(BaseExceptionGroup) as info:
        await own(actor, Msg("refuse"))
    assert [type(e) for e in leaves(info.value)] == [RefusedError]


async def test_bug_fails_reply_and_reaches_owner(recorder):
    actor = recorder()
    reply: Reply[object] = Reply()
    other_cancelled = False

    async def bystander() -> None:
        nonlocal other_cancelled
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            other_cancelled = True
            raise

    with pytest.raises(BaseExceptionGroup) as info:
        await own(actor, Msg("boom", reply), bystander)
    errors = leaves(info.value)
    assert [type(e) for e in errors] == [RuntimeError]
    assert "a bug in the actor" in str(errors[0])
    assert other_cancelled  # the owner's task group cancelled its other tasks
    assert actor.stopped  # clean-up ran
    assert reply.done
    with pytest.raises(ActorStoppedError, match="recorder failed"):
        await reply.wait()
    # The dead actor refuses new work instead of hanging the sender.
    with pytest.raises(ActorStoppedError, match="not running"):
        await actor.send(Msg("late"))


async def test_close_drains_buffered_messages_then_ends(recorder):
    actor = recorder()
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        await actor.send(Msg("a"))
        await actor.send(Msg("b"))
        actor.close()
    # The task group exited on its own: run() returned after the buffered messages.
    assert actor.seen == ["a", "b"]
    assert actor.stopped


async def test_send_after_close_raises_actor_stopped(recorder):
    actor = recorder()
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.close()
        with pytest.raises(ActorStoppedError, match="recorder is not running"):
            await actor.send(Msg("late"))
    with pytest.raises(ActorStoppedError):
        await actor.send(Msg("later"))
    assert actor.seen == []


async def test_owner_cancellation_runs_on_stop(recorder):
    actor = recorder()
    gate = anyio.Event()
    with anyio.move_on_after(5) as scope:
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            await actor.send(Msg("stuck", gate=gate))
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert not scope.cancelled_caught
    assert actor.stopped  # shielded clean-up ran under cancellation
    with pytest.raises(ActorStoppedError):
        await actor.send(Msg("late"))


def test_reply_first_answer_wins():
    reply: Reply[int] = Reply()
    assert not reply.done
    reply.set(1)
    reply.set(2)
    reply.fail(RuntimeError("ignored"))
    assert reply.done

    async def get() -> int:
        return await reply.wait()

    assert anyio.run(get) == 1
