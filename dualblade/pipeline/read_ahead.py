"""Which layer a decode step reads next into a freed read buffer: slow layers first.

Why not plain layer order: a decode step uses its layers in order, and each read lands in one
of a few reused buffers. Read in layer order, a direct layer (the disk) is only asked for when
a buffer frees one or two layers before its use, so while the page-cache layers between two
direct layers are read (memory copies, a few milliseconds each) the disk idles. Under the dual
policy that idle time was much of what a step cost beyond its floor, the larger of the two
paths' times: in the quick preset at 2 GiB dual's steady steps took 0.46-0.52 s against a floor
of 0.29-0.31 s, and 0.34-0.40 s read in this order with four transfers per copy thread on the
host (either change alone gained under 0.05 s: docs/bench.md).

So a freed buffer goes to the next *slow* layer ahead (one the caller marks, the direct ones)
while the next layer in order is already being read: the disk is asked for its next layer as
soon as the last one is in, and the page-cache layers in between take turns in the other
buffers. At most ``buffers - 1`` reads are ahead of the order, so one buffer is always left
for the layer the caller needs next: the walk never waits on a buffer that a later layer holds.

A step may begin with layers already read: the previous step's order ran on into this one's
first reads (:meth:`ReadAhead.then`) and read them in its tail, into buffers its layers had
left (:meth:`ReadAhead.adopt`, and ``dualblade.models.LayerWalk``, which walks the steps). The
order then starts from the first layer not yet read.

Pure: no I/O, no clock. A context gives its own (``KVContext.read_order``); the OPT engine's
decode and the bench's decode walk follow it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dualblade.pipeline.medium import Medium


def decode_read_buffers(read_parallelism: int) -> int:
    """Read buffers a decode step walks its layers with: one per read kept in flight (the
    store's ``read_parallelism``) and one for the layer in use.

    With one buffer per read and none more, a direct layer that has landed holds its buffer
    until every layer before it is used, and the disk idles meanwhile: in the quick preset at
    2 GiB (two copy threads, the bench's walk) the disk's reads were in flight 80-85 % of a
    step with two buffers and 91-99 % with three. The third buffer's memory leaves one layer
    fewer in the page cache there, so the decode took about as long (median 2.33 s against
    2.40 over ten alternating runs each; docs/bench.md). The OPT engine's decode and the
    bench's single-context walks (the sweep, the pressure preset) use this count, so they walk
    as the engine reads. The serving preset's requests keep one per copy thread: each request
    in flight holds its buffers, and the extra one cost dual a tenth of its tokens/s at
    640 MiB (docs/serving-bench.md).
    """
    return max(1, read_parallelism) + 1


class ReadAhead:
    """The read order of one decode step over ``num_layers`` layers and ``buffers`` buffers.

    Args:
        num_layers: layers the step uses, in order ``0..num_layers-1``.
        buffers: read buffers; each holds one layer from its read until its use is done.
        slow_layers: layers whose reads should start as early as a buffer allows (the direct
            ones); the rest are read in layer order.

    Raises:
        ValueError: no layers or no buffers, or a slow layer out of range.
    """

    def __init__(self, num_layers: int, buffers: int, slow_layers: Iterable[int] = ()) -> None:
        if num_layers < 1 or buffers < 1:
            raise ValueError(f"a read order needs layers and buffers, got {num_layers}, {buffers}")
        self.num_layers = num_layers
        self.buffers = buffers
        self._slow = sorted(set(slow_layers))
        self._slow_set = frozenset(self._slow)
        if self._slow and not (self._slow[0] >= 0 and self._slow[-1] < num_layers):
            raise ValueError(f"slow layers {self._slow} fall outside 0..{num_layers - 1}")
        self._issued: dict[int, int] = {}  # layer -> buffer, until used
        self._done: set[int] = set()  # issued, in any state
        self._next_use = 0
        self._next_in_order = 0  # smallest layer not yet issued
        self._started = False

    @classmethod
    def for_media(cls, media: Sequence[Medium], buffers: int) -> ReadAhead:
        """The order for a context whose layer ``i`` lives on ``media[i]``: its direct layers
        are the slow ones (a disk against a memory copy)."""
        slow = [layer for layer, medium in enumerate(media) if medium is Medium.DIRECT]
        return cls(len(media), buffers, slow)

    @property
    def slow_layers(self) -> tuple[int, ...]:
        """The layers read as early as a buffer allows, in order."""
        return tuple(self._slow)

    def then(self, following: ReadAhead, *, carry: int) -> ReadAhead:
        """One order over this step's layers and then the first ``carry`` reads of
        ``following``'s (the first its :meth:`start` would issue), numbered after this one's
        (its layer ``i`` is ``num_layers + i`` here): a step that reads the next step's first
        layers in its tail (``dualblade.models.LayerWalk``). The next step's other layers are
        left to it.

        Under one order, the next step's slow layers are read ahead like this step's own: once
        this step's last slow layer is asked for, a freed buffer goes to the next step's first
        one, while this step's page-cache layers take turns in the others. Read only once this
        step's buffers freed at its end, the disk idled between its last direct layer and the
        next step's first (10-18 ms a step of 0.39 s in the quick preset at 2 GiB). With
        ``carry`` one fewer than the buffers, the next step starts with a buffer free for its
        next read.

        Raises:
            ValueError: the orders have different buffers, either has begun, or ``carry`` is
                outside ``0..buffers``.
        """
        if following.buffers != self.buffers:
            raise ValueError(f"orders of {self.buffers} and {following.buffers} buffers differ")
        if self._started or self._issued or following._started or following._issued:
            raise ValueError("orders are joined before either adopts a layer or starts")
        if not 0 <= carry <= self.buffers:
            raise ValueError(f"a step carries 0 to {self.buffers} layers, not {carry}")
        first_reads = ReadAhead(following.num_layers, following.buffers, following._slow)
        carried = {layer for layer, _ in first_reads.start()[:carry]}
        slow = [*self._slow, *(self.num_layers + layer for layer in following._slow)]
        joined = ReadAhead(self.num_layers + following.num_layers, self.buffers, slow)
        # The next step's layers not carried count as issued: this order never reads them.
        joined._done.update(
            self.num_layers + layer for layer in range(following.num_layers) if layer not in carried
        )
        return joined

    def adopt(self, layer: int, buffer: int) -> None:
        """``layer`` is already read into ``buffer`` (by the step before, in its tail): the
        order counts it as issued and :meth:`start` leaves that buffer alone.

        Raises:
            ValueError: after :meth:`start`, a layer or buffer out of range, or one adopted
                twice.
        """
        if self._started:
            raise ValueError("layers are adopted before the order starts")
        if not (0 <= layer < self.num_layers and 0 <= buffer < self.buffers):
            raise ValueError(
                f"layer {layer} into buffer {buffer} falls outside "
                f"{self.num_layers} layers and {self.buffers} buffers"
            )
        if layer in self._done or buffer in self._issued.values():
            raise ValueError(f"layer {layer} or buffer {buffer} is adopted twice")
        self._issue(layer, buffer)

    def start(self) -> list[tuple[int, int]]:
        """The first reads: ``(layer, buffer)`` for every buffer that gets a layer (every
        buffer no adopted layer holds, while layers remain)."""
        self._started = True
        held = set(self._issued.values())
        starts = []
        for buffer in range(self.buffers):
            if buffer in held:
                continue
            layer = self._choose()
            if layer is None:
                break
            starts.append(self._issue(layer, buffer))
        return starts

    def used(self, layer: int) -> tuple[int, int] | None:
        """``layer`` was used (the caller is done with its buffer); returns the next read,
        ``(layer, buffer)``, into that buffer, or None when every layer is read.

        Raises:
            ValueError: ``layer`` is not the next one in order, or was never read.
        """
        if layer != self._next_use or layer not in self._issued:
            raise ValueError(f"layer {layer} used out of order (next is {self._next_use})")
        buffer = self._issued.pop(layer)
        self._next_use += 1
        chosen = self._choose()
        return None if chosen is None else self._issue(chosen, buffer)

    def _choose(self) -> int | None:
        while self._next_in_order in self._done:
            self._next_in_order += 1
        first = self._next_in_order
        if first >= self.num_layers:
            return None
        if first == self._next_use or first in self._slow_set:
            return first  # needed next (or slow itself): never skipped
        ahead = sum(1 for layer in self._issued if layer > first)
        if ahead < self.buffers - 1:
            for layer in self._slow:
                if layer > first and layer not in self._done:
                    return layer
        return first

    def _issue(self, layer: int, buffer: int) -> tuple[int, int]:
        self._issued[layer] = buffer
        self._done.add(layer)
        return layer, buffer
