"""One (policy, limit) run of the serving preset, in a process of its own inside its cgroup.

Run as ``python -m dualblade.bench.serving_worker SPEC.json``. Like the sweep's worker it joins
its memory cgroup before importing torch, makes the application's memory (the requests' read
buffers and content, or the model) before the store opens, and lets the budgeter discover the
limit. Then every request of the spec is served on the one store (:mod:`.serving_workload`, or
the OPT engine with ``compute``) and the result JSON holds each request's record, the residency
samples, the ledger at the end and the store's path counters.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from dualblade.bench.worker_process import run_worker
from dualblade.collector import freeze_setup


class _Provider:
    """The store as the OPT engine's KV provider, telling the sampler which contexts live."""

    def __init__(self, store: Any, sampler: Any) -> None:
        self._store = store
        self._sampler = sampler

    @property
    def read_parallelism(self) -> int:
        return int(self._store.read_parallelism)

    def iteration(self) -> Any:
        return self._store.iteration()

    def metrics(self) -> dict[str, Any]:
        return dict(self._store.metrics())

    @contextlib.asynccontextmanager
    async def context(
        self, *, batch: int | None = None, max_len: int | None = None
    ) -> AsyncIterator[Any]:
        async with self._store.context(batch=batch, max_len=max_len) as ctx:
            self._sampler.live[ctx.id] = ctx
            try:
                yield ctx
            finally:
                self._sampler.live.pop(ctx.id, None)


async def _serve_model(store: Any, requests: list[Any], model: Any) -> tuple[list[Any], Any]:
    """Real inference: each request generates with the OPT engine in a context of its shape."""
    import anyio

    from dualblade.bench.serving_workload import RequestRecord, ResidencySampler, sleep_until
    from dualblade.errors import plain_errors
    from dualblade.models import random_prompts

    start = time.perf_counter()
    sampler = ResidencySampler(store, start)
    provider = _Provider(store, sampler)
    records = [RequestRecord(spec) for spec in requests]

    async def serve(record: Any) -> None:
        spec = record.spec
        prompts = random_prompts(spec.batch, spec.prompt_len, model.arch.vocab_size, spec.index)
        await sleep_until(spec.arrival_s, lambda: time.perf_counter() - start)
        record.opened_s = last = time.perf_counter()
        stream = model.stream(prompts, spec.new_tokens, provider, fit=True)
        async with contextlib.aclosing(stream) as tokens:
            async for _ in tokens:
                now = time.perf_counter()
                if record.first_token_s == 0.0:
                    record.first_token_s = now - start
                else:
                    record.step_s.append(now - last)
                last = now
        record.opened_s -= start
        record.finished_s = time.perf_counter() - start

    with plain_errors():
        async with anyio.create_task_group() as outer:
            outer.start_soon(sampler.run)
            async with anyio.create_task_group() as tg:
                for record in records:
                    tg.start_soon(serve, record)
            outer.cancel_scope.cancel()
    sampler.sample()
    return records, sampler


async def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Serve the spec's requests on one store and gather the run's figures."""
    import torch

    from dualblade.bench.serving_requests import RequestSpec
    from dualblade.bench.serving_workload import ServingKV, request_buffers, run_serving_workload
    from dualblade.pipeline import config_from_mapping
    from dualblade.store import open_store

    config = config_from_mapping(spec["config"], source="serving spec", env={})
    shape = config.shape()
    requests = [RequestSpec(**r) for r in spec["requests"]]
    device = spec.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    model = data = None
    buffers: dict[int, Any] = {}
    if spec.get("compute"):
        from dualblade.models import build_model, compute_dtype

        compute = spec["compute"]
        model = build_model(
            preset=compute["preset"],
            seed=compute.get("seed", 0),
            device=device,
            dtype=compute_dtype(compute.get("dtype", "float32")),
        )
    else:
        data = ServingKV(
            max(r.prompt_len for r in requests),
            max(r.batch for r in requests),
            shape.kv_width,
            shape.dtype,
            spec.get("seed", 0),
        )
        for r in requests:
            buffers[r.index] = request_buffers(
                r, shape.kv_width, shape.dtype, device, config.copy_threads
            )
    async with open_store(config, device=device, replan=spec.get("replan", True)) as store:
        for held in buffers.values():
            for made_first in held:
                store.fix_read_buffers(made_first)  # as the engine's own buffers are
        freeze_setup()  # the model, the requests' buffers and the store outlive the serving
        before = store.stats()
        if model is not None:
            records, sampler = await _serve_model(store, requests, model)
        else:
            assert data is not None
            records, sampler = await run_serving_workload(store, requests, data, buffers)
        after = store.stats()
    reads = {p: after.read_bytes.get(p, 0) - before.read_bytes.get(p, 0) for p in after.read_bytes}
    looked = after.cache_lookup_bytes - before.cache_lookup_bytes
    hits = after.cache_hit_bytes - before.cache_hit_bytes
    total_read = sum(reads.values())
    return {
        "policy": config.policy,
        "compute": spec.get("compute"),
        "device": str(device),
        "requests": [r.to_dict() for r in records],
        "residency": sampler.samples,
        "ledger": after.ledger.to_dict(),
        "read_bytes": reads,
        "hit_rate": hits / total_read if total_read else 0.0,
        "page_cache_path_hit_rate": hits / looked if looked else None,
        "strategy": after.strategy,
        "memory_limit_bytes": after.memory_limit_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m dualblade.bench.serving_worker SPEC.json``."""
    return run_worker(run_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
