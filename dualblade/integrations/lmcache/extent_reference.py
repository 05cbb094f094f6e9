"""``ExtentReferenceAdapter``: our adapter, which has fio read its own direct extents just before
it closes: the disk's reference that ``dualblade lmcache-bench`` sets beside all-direct loads.

Why then, and on those blocks: a reference must read data of the same age, where it lies, in the
same shape as what it bounds (the VMs' disks sit on a host that caches what was written seconds
before). fio reading a file of its own, written and read after the adapter had run, was no
reference: on the VM of docs/lmcache.md it read at 598-911 MB/s while our all-direct loads of
objects stored seconds before ran at 1496. Once closed, the adapter has trimmed its blocks, and a
trimmed range reads back as zeros without the disk. So this adapter reads them while it still
holds them, after LMCache's last load and before it lets go of anything.

What it reads: one sequential O_DIRECT pass through io_uring over the range from the first to
the last direct object held at close, in the adapter's ``max_chunk`` at its ``queue_depth``, as
the loads read theirs, from buffers in huge pages (``run_fio``), since the loads land in
LMCache's L1, in long physical runs: from 4 KiB pages a disk that takes fewer segments than a
chunk has pages split each of fio's reads in two, and our loads beat that reference
(docs/lmcache.md). The report says when the reference was beaten. The binder lays
the objects' runs out one after another, so the range is mostly objects; a trimmed gap inside
it reads as zeros without the disk, which can only make the reference faster. Three passes: the
first reads data as old as the loads read, the next two what the first just read; all three are
reported. The result is JSON at ``adapter_params.reference_out``; a failure is recorded there
and never stops the close.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dualblade.integrations.lmcache.adapter import DualBladeL2Adapter
from dualblade.integrations.lmcache.params import AdapterParamsError
from dualblade.io_engine import run_fio

#: Sequential passes of fio over the extents (see the module docstring).
PASSES = 3


class ExtentReferenceAdapter(DualBladeL2Adapter):
    """:class:`DualBladeL2Adapter` with one more param, ``reference_out`` (a path): where the
    reference read of its direct extents goes, as JSON, when it closes."""

    def __init__(
        self, adapter_params: Mapping[str, Any] | None = None, l1_memory_desc: Any = None
    ) -> None:
        params = dict(adapter_params or {})
        out = params.pop("reference_out", None)
        if not isinstance(out, str | Path):
            raise AdapterParamsError(
                f"adapter_params.reference_out must be a path for ExtentReferenceAdapter, got "
                f"{out!r}"
            )
        self.reference_out = Path(out)
        super().__init__(params, l1_memory_desc)

    def close(self) -> None:
        try:
            if not self._closed:
                self.reference_out.write_text(json.dumps(self._read_extents(), indent=2) + "\n")
        finally:
            super().close()  # a report that cannot be written keeps nothing held either

    def _read_extents(self) -> dict[str, Any]:
        """The reference's report; a failure is its ``error`` (it must never keep the objects
        held)."""
        config = self.setup.config
        target = str(config.storage.direct.path)
        report: dict[str, Any] = {"target": target, "queue_depth": config.queue_depth}
        try:
            ranges = self.direct_ranges()
            if not ranges:
                return {**report, "error": "no object was held on the direct path"}
            start, end = ranges[0][0], ranges[-1][1]
            # the loads' requests are at most max_chunk (and an object of a small store less)
            block = min(config.max_chunk, end - start)
            report |= {"offset": start, "bytes": end - start, "block_size": block}
            report["object_bytes"] = sum(e - s for s, e in ranges)
            report["passes_mbps"] = [
                round(
                    run_fio(
                        target, "read", end - start, block, config.queue_depth, offset=start
                    ).bytes_per_s
                    / 1e6,
                    1,
                )
                for _ in range(PASSES)
            ]
        except Exception as error:
            return {**report, "error": f"{type(error).__name__}: {error}"}
        report["mbps"] = report["passes_mbps"][0]  # data as old as the loads read
        return report
