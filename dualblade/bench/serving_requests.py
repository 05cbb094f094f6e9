"""The requests of a serving run: seeded Poisson arrivals, each with a shape of its own.

A serving run replays the same requests under every policy and limit, so that policies are
compared on one workload: :func:`draw_requests` is a pure function of its arguments. Arrivals
are a Poisson process (exponential gaps of mean ``1 / rate``, the first request at 0); each
request's batch is drawn from ``batches`` and its prompt length uniformly from
``[prompt_min, prompt_max]``, then it decodes ``new_tokens`` steps after its prefill.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dualblade.errors import ConfigError


@dataclass(frozen=True)
class RequestSpec:
    """One request: when it arrives (seconds after the run starts) and its shape."""

    index: int
    arrival_s: float
    batch: int
    prompt_len: int
    new_tokens: int

    @property
    def max_len(self) -> int:
        """Rows its context is sized for: the prompt and the new tokens (the last token is
        produced, never appended, so one row stays unused, as in the OPT engine's contexts)."""
        return self.prompt_len + self.new_tokens

    @property
    def decode_steps(self) -> int:
        """Decode steps after the prefill (the prefill yields the first token)."""
        return self.new_tokens - 1

    def kv_bytes(self, layers: int, row_bytes_per_sequence: int) -> int:
        """K and V of every layer at ``max_len`` rows (``row_bytes_per_sequence``: one row of
        one tensor for one sequence)."""
        return 2 * layers * self.max_len * self.batch * row_bytes_per_sequence

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def draw_requests(
    count: int,
    *,
    seed: int,
    rate: float,
    batches: Sequence[int],
    prompt_min: int,
    prompt_max: int,
    new_tokens: int,
) -> list[RequestSpec]:
    """``count`` requests with seeded Poisson arrivals (``rate`` per second) and shapes.

    Raises:
        ConfigError: no request, a rate that is not positive, an empty batch choice, a prompt
            range that is empty or not positive, fewer than two new tokens.
    """
    if count < 1:
        raise ConfigError(f"a serving run needs at least one request, got {count}")
    if rate <= 0:
        raise ConfigError(f"the arrival rate must be positive, got {rate}")
    if not batches or min(batches) < 1:
        raise ConfigError(f"batch sizes must be positive, got {list(batches)}")
    if not 1 <= prompt_min <= prompt_max:
        raise ConfigError(f"prompt lengths need 1 <= min <= max, got {prompt_min}..{prompt_max}")
    if new_tokens < 2:
        raise ConfigError(
            f"a request needs at least 2 new tokens (1 decode step), got {new_tokens}"
        )
    rng = random.Random(seed)
    out = []
    clock = 0.0
    for index in range(count):
        if index:
            clock += rng.expovariate(rate)
        out.append(
            RequestSpec(
                index=index,
                arrival_s=round(clock, 6),
                batch=rng.choice(list(batches)),
                prompt_len=rng.randint(prompt_min, prompt_max),
                new_tokens=new_tokens,
            )
        )
    return out
