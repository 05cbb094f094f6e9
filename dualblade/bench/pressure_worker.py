"""One variant of the pressure preset, in a process of its own inside its memory cgroup.

Run as ``python -m dualblade.bench.pressure_worker SPEC.json``. One context prefills, then
decodes ``decode_steps`` steps (the sweep's derived content, every read checked). Before step
``squeeze_step`` the squeeze begins: a memory hog in this very process (so in the same cgroup)
allocates and touches ``squeeze.bytes`` of anonymous memory and holds it to the end, or, with
``squeeze.kind = "limit"``, the cgroup's limit is lowered by that much. Each step's time, its
bytes per path and resident bytes, the ledger and the context's page-cache layers are recorded.
After the last step, with the squeeze still on, the run measures its floor where its bytes now
are (:mod:`.floor`: the store's engine reading the context's direct extents and its resident
and non-resident files), and prices the last step's bytes at those rates: the new floor.
"""

from __future__ import annotations

import mmap
import sys
import time
from pathlib import Path
from typing import Any

from dualblade.bench.worker_process import run_worker

_PAGE = 4096


def hog(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, every page written (so charged to the cgroup
    now). Private: ``mmap.mmap(-1, n)`` alone is a shared mapping (shmem), which the kernel
    counts as mapped file pages, not as a process's anonymous memory."""
    memory = mmap.mmap(-1, max(_PAGE, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    chunk = b"\x5a" * (1 << 20)
    for offset in range(0, len(memory), len(chunk)):
        memory[offset : offset + len(chunk)] = chunk[: len(memory) - offset]
    return memory


def lower_limit(spec: dict[str, Any], nbytes: int) -> int:
    """Lower this process's cgroup limit by ``nbytes``; returns the new limit."""
    group = Path(spec["cgroup_procs"]).parent
    limit_file = group / "memory.max"
    if not limit_file.exists():
        limit_file = group / "memory.limit_in_bytes"
    new = int(limit_file.read_text().split()[0]) - nbytes
    limit_file.write_text(str(new))
    return new


async def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Prefill, decode with the squeeze midway, then the floor; returns the run's record."""
    import anyio
    import torch

    from dualblade.bench.floor import DecodeReads, decode_floor, measure_floor_rates
    from dualblade.bench.sweep_workload import derive_kv, read_buffers
    from dualblade.collector import freeze_setup
    from dualblade.errors import plain_errors
    from dualblade.pipeline import Medium, config_from_mapping
    from dualblade.store import open_store

    config = config_from_mapping(spec["config"], source="pressure spec", env={})
    layers = config.shape().num_layers
    device = spec.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    data = derive_kv(config, spec.get("seed", 0))
    buffers = read_buffers(config, device)
    memory = [b.landings[0].buffer for b in buffers if b.landings[0] is not None]
    squeeze = spec["squeeze"]
    held: list[Any] = []
    steps: list[dict[str, Any]] = []
    report: dict[str, Any] = {"policy": config.policy, "replan": spec.get("replan", True)}
    async with open_store(config, device=device, replan=spec.get("replan", True)) as store:
        for made_first in buffers:
            store.fix_read_buffers(made_first)  # as the engine's own buffers are
        freeze_setup()  # the data, the buffers and the store outlive the run
        async with store.context() as ctx:
            started = time.perf_counter()
            for layer in range(layers):
                k, v = data.prompt_rows("K", layer), data.prompt_rows("V", layer)
                await ctx.write(layer, k.to(device), v.to(device))
            report["prefill_s"] = time.perf_counter() - started
            start = time.perf_counter()

            async def squeeze_now() -> None:
                if squeeze["kind"] == "limit":
                    report["limit_after_bytes"] = lower_limit(spec, squeeze["bytes"])
                else:
                    held.append(await anyio.to_thread.run_sync(hog, squeeze["bytes"]))
                report["squeeze_done_s"] = time.perf_counter() - start

            with plain_errors():
                async with anyio.create_task_group() as tg:
                    for step in range(spec["decode_steps"]):
                        if step == spec["squeeze_step"]:
                            # rounded as the steps' start_s are: a step that began just after
                            # the squeeze must not round to before it
                            report["squeeze_at_s"] = round(time.perf_counter() - start, 4)
                            tg.start_soon(squeeze_now)
                        before = store.stats()
                        began = time.perf_counter()
                        async with store.iteration():
                            await _step(ctx, data, step, buffers, device)
                        ended = time.perf_counter()
                        after = store.stats()
                        steps.append(_step_record(before, after, began - start, ended - began))
                        steps[-1]["page_cache_layers"] = ctx.media.count(Medium.PAGE_CACHE)
            last = steps[-1]
            reads = DecodeReads(
                direct=last["read_bytes"].get("direct", 0),
                page_cache=last["read_bytes"].get("page-cache", 0)
                + last["read_bytes"].get("baseline", 0),
                resident=last["resident_bytes"],
            )
            rates = await measure_floor_rates(store, ctx, memory)
            report["floor"] = decode_floor(reads, rates)
            report["final_media"] = [str(m) for m in ctx.media]
        report["ledger"] = store.stats().ledger.to_dict()
    report["steps"] = steps
    report["squeeze"] = squeeze
    held.clear()
    return report


def _step_record(before: Any, after: Any, at: float, seconds: float) -> dict[str, Any]:
    reads = {p: after.read_bytes.get(p, 0) - before.read_bytes.get(p, 0) for p in after.read_bytes}
    return {
        "start_s": round(at, 4),
        "step_s": round(seconds, 5),
        "read_bytes": reads,
        "resident_bytes": after.cache_hit_bytes - before.cache_hit_bytes,
        "ledger_budget_bytes": after.ledger.budget_bytes,
        "ledger_placed_bytes": after.ledger.placed_bytes,
        "demotions": after.ledger.demotions,
        "promotions": after.ledger.promotions,
    }


async def _step(ctx: Any, data: Any, step: int, buffers: list[Any], device: Any) -> None:
    """One decode step in layer order, one read in flight per buffer pair, every read
    checked on a sample of rows, one row appended per layer.

    Each step is walked on its own (nothing read for the next step in its tail): the report
    prices each step's floor from that step's own reads, and a squeeze lands between steps."""
    from dualblade.models import LayerWalk

    async def use(layer: int, k: Any, v: Any) -> tuple[Any, Any]:
        _check(data, "K", layer, k, step)
        _check(data, "V", layer, v, step)
        return (
            data.appended_row("K", layer, step).to(device),
            data.appended_row("V", layer, step).to(device),
        )

    await LayerWalk(ctx, buffers, carry=False).step(use, more=False)


def _check(data: Any, kind: str, layer: int, read: Any, step: int) -> None:
    """A sample of the prompt rows, the newest appended row and one more that rotates with
    the step (so every row is checked again now and then, after moves too): checking every
    appended row every step cost more than the step's reads by the 40th step.

    Raises:
        VerificationError: a checked row differs.
    """
    import torch

    from dualblade.bench.kv_workload import VerificationError
    from dualblade.bench.row_sample import sampled_from

    prompt = data.prompt
    want = data.sampled_prompt_rows(kind, layer, prompt)
    got = sampled_from(read, prompt)
    if not torch.equal(got.view(data.int_dtype), want):
        raise VerificationError(f"layer {layer} {kind}: a prompt row read back wrong")
    appended = read.shape[0] - prompt
    for row in {appended - 1, step % appended} if appended > 0 else ():
        want = data.appended_row(kind, layer, row).view(data.int_dtype)
        got = read[prompt + row : prompt + row + 1].cpu().view(data.int_dtype)
        if not torch.equal(got, want):
            raise VerificationError(f"layer {layer} {kind}: row {prompt + row} read back wrong")


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m dualblade.bench.pressure_worker SPEC.json``."""
    return run_worker(run_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
