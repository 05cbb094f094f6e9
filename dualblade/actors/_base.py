"""The small actor base: a mailbox, a message loop, readiness, and one-shot replies.

An actor owns its state and is reached only through its mailbox, an anyio memory object stream
with a small buffer so a fast sender waits for a slow actor (real backpressure). Actors run in a
task group their owner opens (``await tg.start(actor.run)``); ``run`` signals readiness once the
actor's start-up work is done. Closing the mailbox (:meth:`Actor.close`) ends the loop cleanly
(``EndOfStream``).

Errors: a request that carries a :class:`Reply` gets a :class:`~dualblade.errors.DualbladeError`
raised while handling it delivered to the requester, and the actor goes on: a failed I/O hurts
only the context that asked for it. Anything else is a bug: the reply is failed too, then the
exception leaves ``run`` and the owner's task group cancels the other actors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dualblade.errors import DualbladeError
from dualblade.telemetry import NULL_TRACER, Tracer

T = TypeVar("T")
M = TypeVar("M")

#: Default mailbox buffer: small, so backpressure is felt at once.
MAILBOX_SIZE = 4


class ActorStoppedError(DualbladeError):
    """The actor is not running any more (closed, or died from an error)."""


class Reply(Generic[T]):
    """A one-shot answer to a request message, awaited by the requester.

    Set and awaited within one event loop (all actors share their owner's loop).
    """

    __slots__ = ("_error", "_event", "_value")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def set(self, value: T) -> None:
        """Answer with a value (the first answer wins)."""
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def fail(self, error: BaseException) -> None:
        """Answer with an error, raised in the requester."""
        if not self._event.is_set():
            self._error = error
            self._event.set()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    async def settled(self) -> None:
        """Wait until the reply is answered, either way, without raising its error."""
        await self._event.wait()

    async def wait(self) -> T:
        """The answer; raises the error the actor failed it with."""
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class Actor(ABC, Generic[M]):
    """An actor handling messages of type ``M`` one at a time.

    Args:
        name: shown in logs and as the actor's trace track.
        tracer: where slices of its work are recorded.
        mailbox_size: buffered messages before senders wait.
    """

    def __init__(
        self, name: str, *, tracer: Tracer = NULL_TRACER, mailbox_size: int = MAILBOX_SIZE
    ) -> None:
        self.name = name
        self.tracer = tracer
        send: MemoryObjectSendStream[M]
        receive: MemoryObjectReceiveStream[M]
        send, receive = anyio.create_memory_object_stream[M](mailbox_size)
        self._mailbox = send
        self._inbox = receive
        self.handled = 0
        self._ran = False

    async def send(self, message: M) -> None:
        """Deliver a message, waiting while the mailbox is full.

        Raises:
            ActorStoppedError: the actor has stopped.
        """
        try:
            await self._mailbox.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise ActorStoppedError(f"actor {self.name} is not running") from None

    async def ask(self, message: M, reply: Reply[T]) -> T:
        """Send a request whose ``reply`` the actor answers, and await the answer."""
        await self.send(message)
        return await reply.wait()

    def close(self) -> None:
        """Stop accepting messages; the loop ends after the buffered ones.

        An actor whose ``run`` never began (its owner's start-up was cut short) closes its
        inbox too, so neither end of the mailbox is left open.
        """
        self._mailbox.close()
        if not self._ran:
            self._inbox.close()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The actor's life: start-up, readiness, the message loop, clean-up."""
        self._ran = True
        self.tracer.track(self.name)
        async with self._inbox:
            await self.on_start()
            task_status.started()
            try:
                async for message in self._inbox:
                    await self._dispatch(message)
                    # Drop it while waiting for the next one: the last message must not keep
                    # its tensors (a caller's read buffers) alive until then.
                    del message
            finally:
                self._refuse_leftovers()
                with anyio.CancelScope(shield=True):
                    await self.on_stop()

    def _refuse_leftovers(self) -> None:
        """Answer every request still in the mailbox when the loop ends (cancelled, or died).

        A requester that waits for its reply however long it takes (a context draining an
        accepted transfer before it lets go of its storage) must not wait forever.
        """
        while True:
            try:
                message = self._inbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            reply = getattr(message, "reply", None)
            if isinstance(reply, Reply):
                reply.fail(ActorStoppedError(f"actor {self.name} stopped before handling it"))

    async def _dispatch(self, message: M) -> None:
        reply = getattr(message, "reply", None)
        try:
            await self.handle(message)
        except DualbladeError as error:
            if isinstance(reply, Reply):
                reply.fail(error)
                return
            raise
        except BaseException as error:
            if isinstance(reply, Reply):
                # Cancelled (the owner is stopping) or a bug: the requester may wait for this
                # answer however long it takes, so it gets one either way.
                stopped = isinstance(error, anyio.get_cancelled_exc_class())
                reason = "was stopped" if stopped else f"failed: {error!r}"
                reply.fail(ActorStoppedError(f"actor {self.name} {reason}"))
            raise
        finally:
            self.handled += 1

    async def on_start(self) -> None:
        """Start-up work done before readiness is signalled."""

    async def on_stop(self) -> None:
        """Clean-up when the loop ends (shielded from cancellation)."""

    @abstractmethod
    async def handle(self, message: M) -> None:
        """Handle one message."""
