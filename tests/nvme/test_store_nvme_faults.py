"""Injected errors on the NVMe passthrough path (issue 18): typed errors, nothing wrong served.

The namespace is wrapped in :class:`~dualblade.testing.FaultyTarget`, so injected faults come
back through the passthrough completions the way a failing drive's would: the command's result
turns into an error (EIO) or comes late (slow). Every read either raises a typed error or
returns exactly what was written, a failed write leaves its layer refused until it is written
again, and the store goes on serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_store_nvme import BATCH, HEAD_DIM, HEADS, LAYERS, PROMPT, store_config

from dualblade.errors import DualbladeError
from dualblade.io_engine import NvmeNamespace, Target
from dualblade.store import LayerLostError, open_store
from dualblade.testing import FaultKind, FaultLog, FaultPolicy, FaultyTarget, InjectedIOError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.timeout(300)
async def test_passthrough_faults_are_typed_and_never_serve_a_wrong_byte(
    nvme_namespace_path: Path, tmp_path: Path
) -> None:
    with NvmeNamespace(str(nvme_namespace_path)) as probe:
        lba_size = probe.lba_size
    config = store_config(nvme_namespace_path, lba_size, tmp_path / "page-cache")
    generator = torch.Generator().manual_seed(lba_size + 1)
    policy = FaultPolicy(1.0, kinds=(FaultKind.EIO,), seed=lba_size)
    policy.enabled = False
    log = FaultLog()

    def rows(n: int) -> torch.Tensor:
        return torch.randn((n, BATCH, HEADS * HEAD_DIM), generator=generator).half()

    def faulty(target: Target) -> FaultyTarget:
        return FaultyTarget(target, policy, log=log)

    async with open_store(config, device="cpu", wrap_direct=faulty) as store:
        assert store.runtime.engine.passthrough
        async with store.context() as ctx:
            expected = {}
            for layer in range(LAYERS):
                expected[layer] = (rows(PROMPT), rows(PROMPT))
                await ctx.write(layer, *expected[layer])

            # Every command fails: a read raises, a write loses its layer.
            policy.enabled = True
            with pytest.raises(InjectedIOError) as read_error:
                await ctx.read(0)
            assert read_error.value.serial in {f.serial for f in log.injected}
            with pytest.raises(InjectedIOError):
                await ctx.write(1, rows(PROMPT), rows(PROMPT))
            policy.enabled = False
            with pytest.raises(LayerLostError):
                await ctx.read(1)
            k, v = await ctx.read(0)  # the failed read changed nothing
            assert torch.equal(k, expected[0][0])
            assert torch.equal(v, expected[0][1])
            await ctx.write(1, *expected[1])  # written again, served again

            # Random faults on a third of the commands: errors or exact bytes, nothing else.
            policy.rate = 0.33
            policy.enabled = True
            outcomes = {"exact": 0, "error": 0}
            for _ in range(12):
                for layer in range(LAYERS):
                    try:
                        k, v = await ctx.read(layer)
                    except LayerLostError:
                        raise
                    except DualbladeError:
                        outcomes["error"] += 1
                        continue
                    assert torch.equal(k, expected[layer][0]), f"layer {layer}: wrong K"
                    assert torch.equal(v, expected[layer][1]), f"layer {layer}: wrong V"
                    outcomes["exact"] += 1
            policy.enabled = False
            assert outcomes["exact"] > 0
            assert outcomes["error"] > 0
            for layer in range(LAYERS):
                k, v = await ctx.read(layer)
                assert torch.equal(k, expected[layer][0])

        # The store still serves a new context after all that.
        async with store.context() as fresh:
            k, v = rows(PROMPT), rows(PROMPT)
            await fresh.write(0, k, v)
            got_k, got_v = await fresh.read(0)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
