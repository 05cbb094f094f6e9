"""The OPT decoder run layer by layer with its KV cache in a KV store (FlexLLMGen's loop).

Weights stay on the compute device; the KV cache does not. Prefill runs each layer over the whole
prompt and hands its K and V to the cache (written behind the next layer's compute). Each decode
step then walks the layers again: before computing layer ``i`` it starts the read of layer
``i + 1``, so storage and compute overlap, and it appends layer ``i``'s new row behind it.

On the CPU compute runs in a worker thread (torch releases the GIL in its kernels) so that the
event loop keeps driving the store's actors — the overlap is real on a CPU too, and a service
running several requests keeps all of them moving. On CUDA a decode layer's call only queues
kernels and returns within a millisecond, so it runs on the event loop itself (see
``launch_inline``).

Activations are ``[seq, batch, hidden]``, the layout of the store's tensors, so K and V go to
the cache without a transpose. K and V are rounded to the cache's dtype before attention uses
them, in prefill as in decode: the model computes with exactly the values the cache returns,
which is why every policy, and the in-memory reference, yields the same tokens.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch
import torch.nn.functional as F  # noqa: N812

from dualblade.errors import ConfigError, plain_errors
from dualblade.models.architecture import POSITION_OFFSET, OptArchitecture
from dualblade.models.attention import attention
from dualblade.models.kv import KVCache, KVProvider
from dualblade.models.layer_walk import LayerWalk
from dualblade.models.weights import LayerWeights, OptWeights
from dualblade.pipeline import decode_read_buffers
from dualblade.store import torch_dtype
from dualblade.telemetry import NULL_TRACER, Tracer

T = TypeVar("T")


@dataclass
class Generation:
    """Greedy tokens of one batch and how long producing them took."""

    tokens: torch.Tensor  # [batch, gen_len], int64, on the CPU
    prefill_s: float  # prompt through every layer, to the first new token
    decode_step_s: list[float] = field(default_factory=list)

    @property
    def decode_s(self) -> float:
        return sum(self.decode_step_s)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens (all sequences) per second of prefill plus decode."""
        total = self.prefill_s + self.decode_s
        return self.tokens.numel() / total if total > 0 else 0.0


#: The trace track of the engine's own steps: a step's slice holds its layers' waits for their
#: reads and their computes, in order, beside the store's actors' tracks.
ENGINE_TRACK = "engine"


class OptModel:
    """An OPT decoder whose KV cache lives in a :class:`~dualblade.models.kv.KVProvider`.

    ``tracer``: receives the engine's slices (:data:`ENGINE_TRACK`): the prefill and each decode
    step, and inside them every layer's compute and every wait for a layer's read or for the
    prefill's writes behind. Where a step's time goes is then one look at a trace: a compute
    that holds up the reads, a read that the compute waits for. The track is the model's, so
    it reads as steps for one request at a time; concurrent requests' slices would interleave.
    """

    def __init__(
        self,
        weights: OptWeights,
        *,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.float32,
        tracer: Tracer = NULL_TRACER,
    ) -> None:
        self.tracer = tracer
        self.arch: OptArchitecture = weights.arch
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.kv_dtype = torch_dtype(self.arch.kv_dtype)
        self.weights = weights.to(self.device, compute_dtype)
        self._layers = [self.weights.layer(i) for i in range(self.arch.num_layers)]
        #: warm the decode's kernels under the first prefill of each shape (:meth:`_warm_decode`)
        self.warm_decode = self.device.type == "cuda"
        #: Run a decode step's calls on the event loop, not in a worker thread: on CUDA a call
        #: only queues kernels (a decode layer's run on the device for well under a
        #: millisecond), and the worker-thread round trip cost more than the call. In one H100
        #: trace at 11 GiB every layer's K and V had landed 10-35 ms before the engine reached
        #: it, while each layer's threaded call took 1.4-18 ms (median 4.9): the GIL handed
        #: between the loop, busy with the store's actors, and the worker (docs/bench.md).
        #: Calls that may hold the CPU longer (the prefill's: cuDNN plans its attention for
        #: each new prompt length) or wait for the device (the warm-up) stay in a thread.
        self.launch_inline = self.device.type == "cuda"
        self._warmed: set[tuple[int, int]] = set()  # (batch, prompt rows) warmed

    # -- the math of one piece ---------------------------------------------------------------
    def _embed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Token plus learned position embeddings of ``ids`` ``[seq, batch]`` at ``start``."""
        w = self.weights.tensors
        x = F.embedding(ids.to(self.device), w["embed_tokens.weight"])
        project_in = self.weights.get("project_in.weight")
        if project_in is not None:
            x = F.linear(x, project_in)
        positions = torch.arange(start, start + ids.shape[0], device=self.device) + POSITION_OFFSET
        return x + F.embedding(positions, w["embed_positions.weight"])[:, None, :]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[batch, vocab]`` from the last position of ``x``."""
        w, h = self.weights, x[-1]
        norm = w.get("final_layer_norm.weight")
        if norm is not None:
            h = F.layer_norm(h, (h.shape[-1],), norm, w.get("final_layer_norm.bias"))
        project_out = w.get("project_out.weight")
        if project_out is not None:
            h = F.linear(h, project_out)
        head = w.get("lm_head.weight")
        return F.linear(h, head if head is not None else w.tensors["embed_tokens.weight"])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[seq, batch, hidden]`` to ``[batch, heads, seq, head_dim]``."""
        seq, batch, _ = x.shape
        return x.view(seq, batch, self.arch.num_heads, self.arch.head_dim).permute(1, 2, 0, 3)

    def _cached(self, x: torch.Tensor) -> torch.Tensor:
        """K or V as the cache stores it (its dtype)."""
        return x.to(self.kv_dtype)

    def _layer(
        self,
        index: int,
        x: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer over ``x``; returns its output and the new K and V to cache.

        Without ``past`` (prefill) attention is causal over ``x``; with it (decode, one row)
        the row attends to the cached rows and itself.
        """
        lw: LayerWeights = self._layers[index]
        pre = self.arch.layer_norm_before
        h = self._norm(x, lw.attn_ln_w, lw.attn_ln_b) if pre else x
        q = F.linear(h, lw.q_w, lw.q_b)
        k_new = self._cached(F.linear(h, lw.k_w, lw.k_b))
        v_new = self._cached(F.linear(h, lw.v_w, lw.v_b))
        k, v = k_new, v_new
        if past is not None:
            k, v = torch.cat([past[0], k_new]), torch.cat([past[1], v_new])
        dt = self.compute_dtype
        attn = attention(
            self._heads(q), self._heads(k.to(dt)), self._heads(v.to(dt)), causal=past is None
        )
        attn = attn.permute(2, 0, 1, 3).reshape(x.shape)
        x = x + F.linear(attn, lw.o_w, lw.o_b)
        if not pre:
            x = self._norm(x, lw.attn_ln_w, lw.attn_ln_b)
        h = self._norm(x, lw.ffn_ln_w, lw.ffn_ln_b) if pre else x
        x = x + F.linear(F.relu(F.linear(h, lw.fc1_w, lw.fc1_b)), lw.fc2_w, lw.fc2_b)
        if not pre:
            x = self._norm(x, lw.ffn_ln_w, lw.ffn_ln_b)
        return x, k_new, v_new

    def _warm_decode(self, batch: int, past_rows: int) -> None:
        """One decode-shaped pass (embedding, a layer over ``past_rows`` cached rows, logits)
        on zeros, so that the first real decode step does not pay for its kernels' first
        launch: CUDA loads a kernel's module then (lazy loading), and a decode's kernels (one
        row attending to the cache, skinny GEMMs) are not the prefill's. On the H200 the first
        step of OPT-6.7B at batch 32 took 0.74-1.61 s against 0.41-0.59 s for the later ones,
        its reads stalled for 0.3 s with nothing computing (docs/bench.md)."""
        zeros = functools.partial(torch.zeros, device=self.device)
        x = self._embed(zeros(1, batch, dtype=torch.int64), past_rows)
        past = zeros(past_rows, batch, self.arch.hidden_size, dtype=self.kv_dtype)
        x, _, _ = self._layer(0, x, (past, past))
        self._logits(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    async def _compute(
        self,
        label: str,
        fn: Callable[..., T],
        *args: Any,
        track: str = ENGINE_TRACK,
        queues_only: bool = False,
    ) -> T:
        """Run ``fn`` in a worker thread so the event loop keeps moving KV bytes meanwhile, or
        on the loop itself where it only queues kernels (``queues_only``, a decode step's
        calls, with ``launch_inline``). ``label`` names its slice in the trace (on ``track``:
        work beside the steps' own, such as the warm-up under the prefill, goes on a track of
        its own, or slices would cross).

        An inline call does not yield: the walk's wait for the next layer's read, which follows
        each layer's call, is the loop's turn (it yields even on a read that has landed). A
        yield here as well made two turns a layer; on the busy loop of an 11 GiB decode a turn
        took about 3 ms (docs/bench.md)."""

        def run() -> T:
            with torch.inference_mode():
                return fn(*args)

        with self.tracer.span(track, label):
            if queues_only and self.launch_inline:
                return run()
            return await anyio.to_thread.run_sync(run)

    async def _wait(self, label: str, waited: Awaitable[Any]) -> None:
        """Await ``waited`` (a layer's read, the writes behind), as a slice of the trace."""
        with self.tracer.span(ENGINE_TRACK, label):
            await waited

    # -- the layer loops ---------------------------------------------------------------------
    async def _prefill(
        self, cache: KVCache, ids: torch.Tensor, walk: LayerWalk | None = None
    ) -> torch.Tensor:
        """Run the prompt ``[seq, batch]`` through every layer, writing each layer's K and V.

        ``walk``: the decode that follows, whose first step's first layers are read back once
        their writes land, under the last layers' writes and the logits
        (:meth:`LayerWalk.read_first`)."""
        x = await self._compute("embed", self._embed, ids, 0)
        layers = self.arch.num_layers
        # At most two layers' K and V wait for their write: bounds the memory of write-behind.
        behind = anyio.Semaphore(2)
        written = [anyio.Event() for _ in range(layers)]

        async def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            try:
                await cache.write(layer, k, v)
            finally:
                behind.release()
            written[layer].set()

        with plain_errors():
            async with anyio.create_task_group() as tg:
                shape = (ids.shape[1], ids.shape[0])
                if self.warm_decode and shape not in self._warmed:
                    # under the prefill, whose compute waits for its writes most of the time
                    self._warmed.add(shape)
                    warm = functools.partial(self._compute, track=f"{ENGINE_TRACK} warm-up")
                    tg.start_soon(warm, "decode kernels", self._warm_decode, *shape)
                for layer in range(layers):
                    x, k, v = await self._compute(f"L{layer}", self._layer, layer, x, None)
                    await self._wait("writes behind", behind.acquire())
                    tg.start_soon(write, layer, k, v)
                if walk is not None:
                    walk.read_first(tg, written)
                logits = await self._compute("logits", self._logits, x)
        return logits

    async def _decode(
        self, walk: LayerWalk, tokens: torch.Tensor, position: int, *, more: bool
    ) -> torch.Tensor:
        """One decode step for ``tokens`` ``[batch]`` at ``position``; returns the logits.

        The reads of up to ``len(buffers) - 1`` layers after the one computing are in flight
        meanwhile (the provider's ``read_parallelism``): one layer ahead kept a 4-thread store's
        page-cache path to the GPU at a fraction of what it moves with every thread busy. Each
        read lands in one of the request's reused read buffers, read into again only once
        the layer that used it has been computed, in the cache's read order: its direct layers
        as early as a buffer allows, so the disk is not idle while page-cache layers are read
        (:class:`dualblade.pipeline.ReadAhead`). On the host, direct reads land in the buffers
        straight from storage. ``more``: a step follows, whose first layers this one reads in
        its tail (:class:`LayerWalk`).
        """
        compute = functools.partial(self._compute, queues_only=True)
        x = await compute("embed", self._embed, tokens[None, :], position)

        async def use(
            layer: int, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal x
            x, k_row, v_row = await compute(f"L{layer}", self._layer, layer, x, (k, v))
            return k_row, v_row

        async def waiting(layer: int, until: Awaitable[Any]) -> None:
            await self._wait(f"read L{layer}", until)

        await walk.step(use, more=more, waiting=waiting)
        return await compute("logits", self._logits, x)

    # -- generation ----------------------------------------------------------------------------
    def check_request(self, prompt_ids: torch.Tensor, gen_len: int) -> None:
        """Refuse a request this model cannot run, before any work.

        Raises:
            ConfigError: a prompt that is not ``[batch, seq]`` integer ids within the vocabulary,
                ``gen_len`` below 1, or more positions than the model has.
        """
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] == 0 or prompt_ids.shape[1] == 0:
            raise ConfigError(f"prompt ids must be [batch, seq], got {list(prompt_ids.shape)}")
        if prompt_ids.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"prompt ids must be integers, got {prompt_ids.dtype}")
        if int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= self.arch.vocab_size:
            raise ConfigError(f"prompt ids must lie in [0, {self.arch.vocab_size})")
        if gen_len < 1:
            raise ConfigError(f"gen_len must be at least 1, got {gen_len}")
        total = prompt_ids.shape[1] + gen_len
        if total > self.arch.max_positions:
            raise ConfigError(
                f"prompt ({prompt_ids.shape[1]}) + gen_len ({gen_len}) = {total} exceeds "
                f"{self.arch.name}'s {self.arch.max_positions} positions"
            )

    async def stream(
        self, prompt_ids: torch.Tensor, gen_len: int, kv: KVProvider, *, fit: bool = False
    ) -> AsyncGenerator[torch.Tensor, None]:
        """Greedy-decode ``gen_len`` tokens for ``prompt_ids`` ``[batch, seq]``, one step at a
        time: yields each step's tokens ``[batch]`` (CPU int64).

        One context of ``kv`` holds the request's cache for the whole generation; it is released
        when the generator finishes or is closed (use ``contextlib.aclosing``). The first token
        comes from prefill, each further one from a decode step bracketed by
        ``kv.iteration()``, which appends the previous token's K and V.

        ``fit``: a context of the request's own batch and length (prompt + ``gen_len``), as a
        service of requests of many sizes on one store wants; else the store's shape.

        Raises:
            ConfigError: see :meth:`check_request`.
            KVShapeError: the store was configured for another batch or length (or, with
                ``fit``, a smaller one).
        """
        self.check_request(prompt_ids, gen_len)
        ids = prompt_ids.t().contiguous()
        prompt_len = ids.shape[0]
        shape = {"batch": ids.shape[1], "max_len": prompt_len + gen_len} if fit else {}
        async with kv.context(**shape) as cache:
            # Made once per request, reused by every step (aligned memory is made and touched
            # page by page: not per step), before the prefill: it reads the first step's first
            # layers into them. Released with the last reference to them.
            count = decode_read_buffers(kv.read_parallelism)
            walk = LayerWalk(cache, [cache.read_buffers() for _ in range(count)])
            with self.tracer.span(ENGINE_TRACK, "prefill", rows=prompt_len):
                logits = await self._prefill(cache, ids, walk if gen_len > 1 else None)
                token = logits.argmax(dim=-1).cpu()
            yield token
            for step in range(1, gen_len):
                with self.tracer.span(ENGINE_TRACK, f"decode step {step}"):
                    async with kv.iteration():
                        position = prompt_len + step - 1
                        logits = await self._decode(walk, token, position, more=step + 1 < gen_len)
                    token = logits.argmax(dim=-1).cpu()
                yield token

    async def generate(self, prompt_ids: torch.Tensor, gen_len: int, kv: KVProvider) -> Generation:
        """All of :meth:`stream` at once, timed: prefill to the first token, then each step."""
        steps: list[torch.Tensor] = []
        times: list[float] = []
        start = time.perf_counter()
        async with contextlib.aclosing(self.stream(prompt_ids, gen_len, kv)) as tokens:
            async for token in tokens:
                now = time.perf_counter()
                times.append(now - start)
                start = now
                steps.append(token)
        return Generation(torch.stack(steps, dim=1), prefill_s=times[0], decode_step_s=times[1:])
