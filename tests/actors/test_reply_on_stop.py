"""Every request an actor accepted gets an answer, also when the actor is cancelled.

A context that was cancelled waits (shielded) for its copy-thread transfer to settle before it
gives its storage back; if a stopping actor left that reply unanswered, the context would wait
forever. The request being handled and those still in the mailbox are all failed with
:class:`ActorStoppedError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import pytest
from anyio.lowlevel import checkpoint

from dualblade.actors import Actor, ActorStoppedError, Reply

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Ask:
    reply: Reply[int]


class Stuck(Actor[Ask]):
    """Never finishes a request."""

    async def handle(self, message: Ask) -> None:
        await anyio.sleep_forever()


async def test_cancelled_actor_answers_the_current_and_the_queued_requests() -> None:
    actor = Stuck("stuck", mailbox_size=4)
    replies: list[Reply[int]] = [Reply() for _ in range(4)]
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        for reply in replies:
            await actor.send(Ask(reply))
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    actor.close()
    for reply in replies:
        assert reply.done
        with pytest.raises(ActorStoppedError, match="stuck"):
            await reply.wait()


async def test_a_shielded_waiter_is_released_when_the_actor_stops() -> None:
    actor = Stuck("stuck")
    reply: Reply[int] = Reply()
    released = anyio.Event()

    async def requester() -> None:
        await actor.send(Ask(reply))
        with anyio.CancelScope(shield=True):
            await reply.settled()
        released.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as outer:
            outer.start_soon(requester)
            async with anyio.create_task_group() as actors:
                await actors.start(actor.run)
                await anyio.wait_all_tasks_blocked()
                actors.cancel_scope.cancel()
            await released.wait()
    actor.close()
    await checkpoint()
