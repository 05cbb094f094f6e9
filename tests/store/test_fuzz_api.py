"""Fuzzed KVContext calls: wrong layers, shapes, dtypes, row ranges and non-tensors.

Every call either does what a model of the context predicts (and then reads back exactly) or
raises one of our errors (a :class:`~dualblade.errors.DualbladeError`); never another exception
type, and never a success the model says must fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dualblade.errors import DualbladeError
from dualblade.pipeline import PipelineConfig, config_from_mapping
from dualblade.store import BlockingContext, BlockingStore, open_store_blocking

LAYERS, BATCH, KV_HEADS, HEAD_DIM, MAX_LEN = 3, 3, 2, 32, 12
WIDTH = KV_HEADS * HEAD_DIM


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BlockingStore]:
    folder: Path = tmp_path_factory.mktemp("fuzz")
    config: PipelineConfig = config_from_mapping(
        {
            "model": {
                "num_layers": LAYERS,
                "hidden_size": 256,
                "num_heads": 8,
                "num_kv_heads": KV_HEADS,
                "dtype": "bfloat16",
            },
            "workload": {"batch": BATCH, "prompt_len": 8, "max_new_tokens": MAX_LEN - 8},
            "memory": {"page_cache_budget": "8MiB", "knob_x": "64KiB"},
            "storage": {"direct": {"path": str(folder / "d.kv")}, "page_cache_dir": str(folder)},
            "policy": "dual",
        },
        env={},
    )
    with open_store_blocking(config, device="cpu") as opened:
        yield opened


# -- inputs ---------------------------------------------------------------------------------------
_bad_layers = st.one_of(
    st.integers(-2, LAYERS + 1),
    st.sampled_from([True, 1.0, None, "0", 2**70, -(2**70)]),
)
#: Seven in ten layers are valid, so that most sequences get past their first write.
layers = st.integers(0, 9).flatmap(lambda i: st.integers(0, LAYERS - 1) if i < 7 else _bad_layers)
dtypes = st.sampled_from([torch.bfloat16] * 12 + [torch.float16, torch.float32, torch.int16])


@st.composite
def tensors(draw: st.DrawFn, rows: int | None = None) -> Any:
    """Mostly well-formed tensors of random rows; sometimes a wrong dim, dtype or type."""
    if draw(st.integers(0, 29)) == 0:
        return draw(st.sampled_from([None, [1.0, 2.0], "k", 3]))
    n = rows if rows is not None else draw(st.integers(1, MAX_LEN) | st.integers(0, MAX_LEN + 2))
    shape: tuple[int, ...] = (n, BATCH, WIDTH)
    form = draw(st.integers(0, 14))
    if form == 0:
        shape = (n, BATCH, KV_HEADS, HEAD_DIM)
    elif form == 1:
        shape = (n, draw(st.integers(1, 5)), draw(st.sampled_from([WIDTH, WIDTH // 2, 65])))
    elif form == 2:
        shape = (BATCH, WIDTH)
    elif form == 3:
        shape = (n, BATCH * WIDTH)
    seed = draw(st.integers(0, 2**16))
    raw = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=_gen(seed))
    dtype = draw(dtypes)
    tensor = raw.view(torch.bfloat16).to(dtype) if dtype != torch.int16 else raw
    if len(shape) == 3 and draw(st.booleans()):
        tensor = tensor.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided
    return tensor


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


row_ranges = st.one_of(
    st.none(),
    st.none(),
    st.tuples(st.integers(0, 4), st.integers(1, 8)),
    st.tuples(st.integers(-2, MAX_LEN + 2), st.integers(-2, MAX_LEN + 2)),
    st.sampled_from([(0,), (0, 1, 2), [0, 1], (0.5, 2), "0:2", (True, 2), 3]),
)


@st.composite
def operations(draw: st.DrawFn) -> tuple[str, Any, Any, Any]:
    op = draw(st.sampled_from(["write", "append", "read"]))
    layer = draw(layers)
    if op == "write":
        k = draw(tensors())
        rows = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() else None
        v = draw(tensors(rows if draw(st.integers(0, 9)) else None))
        return op, layer, k, v
    if op == "append":
        return op, layer, draw(tensors(1)), draw(tensors(1))
    return op, layer, draw(row_ranges), None


# -- the model ------------------------------------------------------------------------------------
def _valid_layer(layer: object) -> bool:
    return type(layer) is int and 0 <= layer < LAYERS


def _as_rows(t: object, rows: int | None) -> torch.Tensor | None:
    """The tensor as ``[rows, BATCH, WIDTH]`` if it is acceptable, else None."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
        return None
    shape = tuple(t.shape)
    if len(shape) == 4 and shape[1:] == (BATCH, KV_HEADS, HEAD_DIM):
        t = t.reshape(shape[0], BATCH, WIDTH)
    elif len(shape) == 2 and rows == 1 and shape == (BATCH, WIDTH):
        t = t.reshape(1, BATCH, WIDTH)
    if tuple(t.shape[1:]) != (BATCH, WIDTH) or t.dim() != 3:
        return None
    if rows is not None and t.shape[0] != rows:
        return None
    return t


def _expect(model: dict[int, torch.Tensor], op: tuple[str, Any, Any, Any]) -> Any:
    """What the call must return/do, or ``DualbladeError`` when it must be refused."""
    kind, layer, a, b = op
    if not _valid_layer(layer):
        return DualbladeError
    if kind == "write":
        k = _as_rows(a, None)
        v = _as_rows(b, k.shape[0] if k is not None else None)
        if k is None or v is None or not 0 < k.shape[0] <= MAX_LEN:
            return DualbladeError
        return ("stored", k, v)
    if kind == "append":
        k, v = _as_rows(a, 1), _as_rows(b, 1)
        have = model.get(layer)
        length = 0 if have is None else have[0].shape[0]
        if k is None or v is None or length >= MAX_LEN:
            return DualbladeError
        return ("appended", k, v)
    length = 0 if layer not in model else model[layer][0].shape[0]
    if a is None:
        start, stop = 0, length
    elif type(a) in (tuple, list) and len(a) == 2 and all(type(x) is int for x in a):
        start, stop = a
    else:
        return DualbladeError
    if not 0 <= start < stop <= length:
        return DualbladeError
    return ("read", start, stop)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _run(ctx: BlockingContext, model: dict[int, Any], op: tuple[str, Any, Any, Any]) -> None:
    want = _expect(model, op)
    kind, layer, a, b = op
    result: Any = None
    refused: DualbladeError | None = None
    try:
        if kind == "write":
            ctx.write(layer, a, b)
        elif kind == "append":
            result = ctx.append(layer, a, b)
        else:
            result = ctx.read(layer, a)
    except DualbladeError as error:
        refused = error
    if refused is not None:
        event(f"{kind} refused")
        assert want is DualbladeError, f"{kind} refused although valid: {refused}"
        assert str(refused)  # a message a user can act on
        return
    assert want is not DualbladeError, f"{kind}({layer!r}, ...) was accepted: must be refused"
    event(f"{kind} done")
    if want[0] == "stored":
        model[layer] = (want[1].clone(), want[2].clone())
    elif want[0] == "appended":
        old_k, old_v = model.get(layer, (want[1][:0], want[2][:0]))
        model[layer] = (torch.cat([old_k, want[1]]), torch.cat([old_v, want[2]]))
        assert result == model[layer][0].shape[0]
    else:
        _, start, stop = want
        k, v = result
        assert _same(k, model[layer][0][start:stop])
        assert _same(v, model[layer][1][start:stop])


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(operations(), min_size=1, max_size=8))
def test_fuzzed_calls_give_our_errors_or_exact_results(
    store: BlockingStore, ops: list[tuple[str, Any, Any, Any]]
) -> None:
    model: dict[int, Any] = {}
    with store.context() as ctx:
        for op in ops:
            _run(ctx, model, op)
        for layer, (k, v) in model.items():  # everything the model holds reads back exactly
            got_k, got_v = ctx.read(layer)
            assert _same(got_k, k)
            assert _same(got_v, v)


@pytest.mark.anyio
@pytest.mark.parametrize(("field", "value"), [("hidden_size", 2**36), ("num_heads", 1)])
async def test_a_kpu_too_large_for_memory_is_our_error(
    tmp_path: Path, field: str, value: int
) -> None:
    """The pinned buffers hold one KPU each; one that cannot be allocated is a DualbladeError
    naming the buffer (mmap's bare OSError before)."""
    from dualblade.store import open_store

    model: dict[str, Any] = {"num_layers": 2, "hidden_size": 2**36, "num_heads": 8}
    model[field] = value
    config = config_from_mapping(
        {
            "model": model,
            "workload": {"batch": 4, "prompt_len": 16, "max_new_tokens": 0},
            "memory": {"page_cache_budget": "8MiB"},
            "storage": {
                "direct": {"path": str(tmp_path / "d.kv")},
                "page_cache_dir": str(tmp_path),
            },
        },
        env={},
    )
    with pytest.raises(DualbladeError, match="buffer"):
        async with open_store(config, device="cpu"):
            pytest.fail("a store with terabyte KPUs must not open")
