"""The strategy-probe actor: picks how storage reads and GPU DMAs of copy threads overlap.

Two strategies (DESIGN §2, mechanism 3):

- *Overlap-Intra*: the storage reads of all copy threads run concurrently; GPU DMAs run one
  after another. Best while the device has bandwidth to spare.
- *Overlap-Cross*: one storage read at a time, so the next thread's read overlaps the previous
  thread's GPU DMA instead of competing with the other reads for the device.

Both are one :class:`OverlapGate` with a different number of storage slots per I/O path. Each path
has slots of its own: the page-cache path and the direct path are two storage stacks (a page-cache
hit is a copy out of memory, a direct read a command to the device), and dual places a context's
layers on both so that their bandwidths add. With one set of slots for both, a step's page-cache
read waited behind the direct read before it on the same slots, and a step took the sum of its two
paths' times (docs/bench.md).

Cross delays only the reads that reach a storage device (:data:`CROSS_PATHS`): it exists because
concurrent reads contend for the SSD (the paper's throughput analysis). A page-cache read is a
memory copy by a CPU, and one at a time only idles the others: on the H200 machine, with every
layer of OPT-6.7B in the page cache, the Cross iteration took 1.44-1.63 s against 0.40-0.50 s for
the steps around it, a quarter of a seven-step decode (docs/bench.md).

In ``auto`` mode the probe skips decode iteration 1 (cold caches), runs iteration 2 with Intra and
iteration 3 with Cross, compares their throughput and locks the faster one; a budget change restarts
the probe at the next iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dualblade.actors._base import Actor, Reply
from dualblade.io_engine import StorageSlots
from dualblade.logs import get_logger
from dualblade.telemetry import NULL_TRACER, Tracer

StrategyName = Literal["intra", "cross"]
ProbeMode = Literal["auto", "intra", "cross"]

_log = get_logger(__name__)

#: The I/O paths whose reads Overlap-Cross takes one at a time: those that reach the device.
CROSS_PATHS = frozenset({"direct"})


class OverlapGate:
    """Storage slots shared by the copy threads, per I/O path: as many as there are copy threads,
    or one on a device's path (:data:`CROSS_PATHS`) under Cross."""

    def __init__(self, copy_threads: int, strategy: StrategyName = "intra") -> None:
        self.copy_threads = copy_threads
        self._limiters: dict[str, StorageSlots] = {}
        self.strategy: StrategyName = strategy
        self.set(strategy)

    def slots_for(self, path: str) -> int:
        """Storage transfers at once on ``path`` under the current strategy."""
        return 1 if self.strategy == "cross" and path in CROSS_PATHS else self.copy_threads

    def set(self, strategy: StrategyName) -> None:
        """Switch strategy; reads in progress finish under the old one."""
        self.strategy = strategy
        for path, limiter in self._limiters.items():
            limiter.total_tokens = self.slots_for(path)

    def limiter_for(self, path: str) -> StorageSlots:
        """Hold one of ``path``'s slots around a storage transfer on that path (``async with``),
        or hand them to the engine with the transfer (``pread(..., slots=)``), which passes a
        slot on from a finished transfer to the next without the event loop."""
        limiter = self._limiters.get(path)
        if limiter is None:
            limiter = self._limiters[path] = StorageSlots(self.slots_for(path))
        return limiter


@dataclass(frozen=True)
class IterationStart:
    """A decode iteration begins; the reply says which strategy it runs with."""

    step: int
    reply: Reply[StrategyName]


@dataclass(frozen=True)
class IterationEnd:
    """A decode iteration ended, having moved ``nbytes`` in ``seconds``."""

    step: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class BudgetChanged:
    """The page-cache budget changed: probe again."""

    page_cache_bytes: int


@dataclass(frozen=True)
class TrafficChanged:
    """The mix of contexts the store serves changed (``active`` contexts now): the traffic the
    last probe measured is not the traffic now; probe again."""

    active: int


@dataclass(frozen=True)
class GetStrategy:
    """Ask for the probe's state."""

    reply: Reply[ProbeState]


@dataclass(frozen=True)
class ProbeState:
    """What the probe decided so far."""

    strategy: StrategyName
    locked: bool
    throughput: dict[str, float]


ProbeMessage = IterationStart | IterationEnd | BudgetChanged | TrafficChanged | GetStrategy


class StrategyProbeActor(Actor[ProbeMessage]):
    """Runs the probe and owns the overlap gate's setting.

    Args:
        gate: the gate the copy threads acquire around storage transfers.
        mode: ``auto`` probes; ``intra``/``cross`` fix the strategy.
    """

    def __init__(
        self, gate: OverlapGate, mode: ProbeMode = "auto", *, tracer: Tracer = NULL_TRACER
    ) -> None:
        super().__init__("strategy-probe", tracer=tracer)
        self.gate = gate
        self.mode: ProbeMode = mode
        self.locked = mode != "auto"
        if mode != "auto":
            gate.set(mode)
        self._probe_start = 1  # the decode step that is "iteration 1" of the probe
        self._restart_at_next = False
        self._throughput: dict[str, float] = {}
        self._phase_of_step: dict[int, str] = {}
        self.reprobes = 0  # budget or traffic changes that asked for a new probe

    def _phase(self, step: int) -> str:
        position = step - self._probe_start + 1
        return {1: "warmup", 2: "intra", 3: "cross"}.get(position, "locked")

    async def handle(self, message: ProbeMessage) -> None:
        if isinstance(message, IterationStart):
            if self._restart_at_next:
                self._probe_start = message.step
                self._restart_at_next = False
            phase = "locked" if self.locked else self._phase(message.step)
            if phase in ("intra", "cross"):
                self.gate.set(phase)  # type: ignore[arg-type]
            self._phase_of_step[message.step] = phase
            self.tracer.instant(
                self.name, f"iteration {message.step}", phase=phase, strategy=self.gate.strategy
            )
            message.reply.set(self.gate.strategy)
        elif isinstance(message, IterationEnd):
            phase = self._phase_of_step.pop(message.step, "locked")
            if phase in ("intra", "cross") and message.seconds > 0:
                self._throughput[phase] = message.nbytes / message.seconds
                self.tracer.counter("probe throughput", **{phase: self._throughput[phase]})
            if phase == "cross" and not self.locked:
                self._lock()
        elif isinstance(message, BudgetChanged | TrafficChanged):
            self.reprobes += 1
            if self.mode == "auto":
                self.locked = False
                self._throughput.clear()
                # Iterations in flight measured the old placement: their ends must neither
                # record a throughput nor lock (a lock here would skip the re-probe).
                self._phase_of_step.clear()
                self._restart_at_next = True
        elif isinstance(message, GetStrategy):
            message.reply.set(ProbeState(self.gate.strategy, self.locked, dict(self._throughput)))

    def _lock(self) -> None:
        intra = self._throughput.get("intra", 0.0)
        cross = self._throughput.get("cross", 0.0)
        winner: StrategyName = "cross" if cross > intra else "intra"
        self.gate.set(winner)
        self.locked = True
        self.tracer.instant(self.name, "locked", strategy=winner, intra=intra, cross=cross)
        _log.info("strategy locked", strategy=winner, intra_bps=intra, cross_bps=cross)
