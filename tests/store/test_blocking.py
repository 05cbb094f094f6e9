"""The blocking facade: the same store from plain synchronous code."""

from __future__ import annotations

import pytest
import torch

from dualblade.store import KVShapeError, open_store_blocking

from .conftest import random_kv


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_round_trip_from_sync_code(make_config, backend):
    config = make_config("dual", prompt_len=16, max_new_tokens=2)
    with open_store_blocking(config, backend=backend, device="cpu") as store:
        with store.context() as ctx:
            written = {}
            for layer in range(4):
                written[layer] = random_kv(config, 16, seed=layer)
                ctx.write(layer, *written[layer])
            k_row, v_row = random_kv(config, 1, seed=50)
            assert ctx.append(2, k_row, v_row) == 17
            assert ctx.length(2) == 17
            for layer in range(4):
                k, v = ctx.read(layer)
                want_k, want_v = written[layer]
                if layer == 2:
                    want_k, want_v = torch.cat([want_k, k_row]), torch.cat([want_v, v_row])
                assert torch.equal(k, want_k)
                assert torch.equal(v, want_v)
            k, _ = ctx.read(2, (10, 17))
            assert torch.equal(k, torch.cat([written[2][0], k_row])[10:])
            with pytest.raises(KVShapeError, match="never written"):
                ctx.read(0, (0, 17))
        metrics = store.metrics()
        assert metrics["open_contexts"] == 0
        assert metrics["trimmed_blocks"] > 0
