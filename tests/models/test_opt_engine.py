"""The OPT engine: the same math as transformers' OPT, a KV cache that really decides the tokens,
the next layer's read in flight during the current layer's compute, and clear refusals."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dualblade.errors import ConfigError
from dualblade.models.architecture import OptArchitecture
from dualblade.models.checkpoint import save_checkpoint
from dualblade.models.kv import MemoryKV, MemoryKVContext, MemoryKVError
from dualblade.models.opt import OptModel
from dualblade.models.weights import random_weights
from dualblade.pipeline import ReadAhead

pytestmark = pytest.mark.anyio


def memory_kv(model: OptModel, batch: int, max_len: int, dtype: torch.dtype) -> MemoryKV:
    arch = model.arch
    return MemoryKV(
        layers=arch.num_layers, batch=batch, max_len=max_len, width=arch.hidden_size, dtype=dtype
    )


def prompts(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- the same model as transformers' ----------------------------------------------------------
POST_LN = OptArchitecture(
    name="opt-350m-like",
    num_layers=3,
    hidden_size=64,
    num_heads=4,
    ffn_dim=96,
    vocab_size=300,
    max_positions=64,
    layer_norm_before=False,
    word_embed_dim=32,
    kv_dtype="float32",
)


@pytest.mark.parametrize(
    "arch",
    [
        dataclasses.replace(OptArchitecture.from_preset("opt-tiny"), kv_dtype="float32"),
        POST_LN,
    ],
    ids=["pre-ln", "post-ln-projected"],
)
async def test_matches_transformers_opt(arch: OptArchitecture, tmp_path: Path) -> None:
    """Greedy ids equal OPTForCausalLM's on the same checkpoint (float32 KV: no rounding)."""
    transformers = pytest.importorskip("transformers")
    weights = random_weights(arch, seed=3)
    save_checkpoint(weights, tmp_path)
    hf = transformers.OPTForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # a random model may emit id 2: do not stop there
    ids = prompts(2, 16, arch.vocab_size)
    with torch.inference_mode():
        expected = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1)[:, 16:]

    model = OptModel(weights)
    result = await model.generate(ids, 8, memory_kv(model, 2, 24, torch.float32))

    assert result.tokens.tolist() == expected.tolist()
    assert len({t for row in result.tokens.tolist() for t in row}) >= 4  # not one repeated id


# -- the cache decides the tokens -------------------------------------------------------------
class _Perturbed(MemoryKVContext):
    """Reads layer 2's V back slightly wrong: what a store returning wrong bytes would do."""

    async def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = await super().read(layer)
        return (k, v + 0.05) if layer == 2 else (k, v)


class _PerturbedKV(MemoryKV):
    @contextlib.asynccontextmanager
    async def context(self) -> AsyncIterator[MemoryKVContext]:  # type: ignore[override]
        yield _Perturbed(4, 4, 80, 64, torch.float16, torch.device("cpu"))


async def test_tokens_depend_on_the_cached_kv(opt_tiny: OptModel) -> None:
    ids = prompts(4, 64, opt_tiny.arch.vocab_size)
    good = await opt_tiny.generate(ids, 16, memory_kv(opt_tiny, 4, 80, torch.float16))
    again = await opt_tiny.generate(ids, 16, memory_kv(opt_tiny, 4, 80, torch.float16))
    bad = await opt_tiny.generate(ids, 16, _PerturbedKV(**_kv_args()))
    assert torch.equal(good.tokens, again.tokens)
    assert good.tokens[:, 0].tolist() == bad.tokens[:, 0].tolist()  # prefill reads no cache
    assert not torch.equal(good.tokens, bad.tokens)


async def test_the_decode_warm_up_runs_once_per_shape_and_changes_no_token(
    opt_tiny: OptModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the first prefill of a shape also runs a decode-shaped pass on zeros (its
    kernels' first launch off the first step); forced on here, it must not touch the cache or
    the tokens."""
    ids = prompts(4, 64, opt_tiny.arch.vocab_size)
    plain = await opt_tiny.generate(ids, 8, memory_kv(opt_tiny, 4, 80, torch.float16))
    warmed: list[tuple[int, int]] = []
    real = opt_tiny._warm_decode

    def spy(batch: int, past_rows: int) -> None:
        warmed.append((batch, past_rows))
        real(batch, past_rows)

    monkeypatch.setattr(opt_tiny, "_warm_decode", spy)
    monkeypatch.setattr(opt_tiny, "warm_decode", True)
    monkeypatch.setattr(opt_tiny, "_warmed", set())
    first = await opt_tiny.generate(ids, 8, memory_kv(opt_tiny, 4, 80, torch.float16))
    second = await opt_tiny.generate(ids, 8, memory_kv(opt_tiny, 4, 80, torch.float16))
    assert warmed == [(4, 64)]  # once for the shape
    assert torch.equal(first.tokens, plain.tokens)
    assert torch.equal(second.tokens, plain.tokens)


async def test_inline_launches_run_on_the_loop_and_change_no_token(
    opt_tiny: OptModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA a decode step's calls run on the event loop (they only queue kernels); forced
    on here, they must run on the loop's thread, the prefill and the warm-up (which waits for
    the device) in workers, and the tokens must be those of the threaded engine."""
    ids = prompts(4, 64, opt_tiny.arch.vocab_size)
    threaded = await opt_tiny.generate(ids, 6, memory_kv(opt_tiny, 4, 80, torch.float16))
    loop_thread = threading.get_ident()
    engine_calls: list[int] = []  # the thread of each of the engine's own layer calls
    warm_threads: list[int] = []
    warming = threading.local()
    real_layer, real_warm = opt_tiny._layer, opt_tiny._warm_decode

    def layer(*args: Any) -> Any:
        if not getattr(warming, "now", False):  # the warm-up computes one layer itself
            engine_calls.append(threading.get_ident())
        return real_layer(*args)

    def warm(*args: Any) -> None:
        warm_threads.append(threading.get_ident())
        warming.now = True
        try:
            real_warm(*args)
        finally:
            warming.now = False

    monkeypatch.setattr(opt_tiny, "_layer", layer)
    monkeypatch.setattr(opt_tiny, "_warm_decode", warm)
    monkeypatch.setattr(opt_tiny, "launch_inline", True)
    monkeypatch.setattr(opt_tiny, "warm_decode", True)
    monkeypatch.setattr(opt_tiny, "_warmed", set())
    inline = await opt_tiny.generate(ids, 6, memory_kv(opt_tiny, 4, 80, torch.float16))
    assert len(warm_threads) == 1
    assert warm_threads[0] != loop_thread
    layers = opt_tiny.arch.num_layers
    # the prefill's layers in worker threads (cuDNN may plan there), then five steps' (six
    # tokens) on the loop
    assert loop_thread not in engine_calls[:layers]
    assert engine_calls[layers:] == [loop_thread] * (layers * 5)
    assert torch.equal(inline.tokens, threaded.tokens)


def _kv_args() -> dict[str, Any]:
    return {"layers": 4, "batch": 4, "max_len": 80, "width": 64, "dtype": torch.float16}


# -- the layer loop ---------------------------------------------------------------------------
class _Recording(MemoryKVContext):
    def __init__(self, log: list[str], *args: Any) -> None:
        super().__init__(*args)
        self.log = log

    async def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.log.append(f"write {layer}")
        await super().write(layer, k, v)

    async def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.log.append(f"read {layer}")
        return await super().read(layer)

    async def append(self, layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> int:
        self.log.append(f"append {layer}")
        return await super().append(layer, k_row, v_row)


class _RecordingKV(MemoryKV):
    def __init__(self, read_parallelism: int = 1) -> None:
        super().__init__(**_kv_args())
        self.log: list[str] = []
        self._parallelism = read_parallelism

    @property
    def read_parallelism(self) -> int:
        return self._parallelism

    @contextlib.asynccontextmanager
    async def context(self) -> AsyncIterator[MemoryKVContext]:  # type: ignore[override]
        yield _Recording(self.log, 4, 4, 80, 64, torch.float16, torch.device("cpu"))

    @contextlib.asynccontextmanager
    async def iteration(self) -> AsyncIterator[None]:
        self.log.append("step")
        async with super().iteration():
            yield


def _phases(log: list[str]) -> list[list[str]]:
    """The log cut at each decode step: the prefill's events, then each step's."""
    starts = [i for i, event in enumerate(log) if event == "step"]
    return [
        log[a + 1 if a else 0 : b] for a, b in zip([0, *starts], [*starts, len(log)], strict=True)
    ]


def _reads(events: list[str]) -> list[int]:
    return [int(event.split()[1]) for event in events if event.startswith("read")]


async def test_prefill_writes_then_each_step_reads_ahead_and_into_the_next(
    opt_tiny: OptModel,
) -> None:
    # One read in flight (two buffers): the prefill reads layer 0 back once it is written; each
    # step reads the next layer before computing one, and every step but the last reads the
    # next step's layer 0 in its tail, after this step's append of it (it must hold the row).
    kv = _RecordingKV()
    await opt_tiny.generate(prompts(4, 64, 1024), 3, kv)
    prefill, *steps = _phases(kv.log)
    assert sorted(e for e in prefill if e.startswith("write")) == [f"write {i}" for i in range(4)]
    assert _reads(prefill) == [0]
    assert prefill.index("read 0") > prefill.index("write 0")
    assert len(steps) == 2  # 3 tokens: one from prefill, two decode steps
    for number, step in enumerate(steps):
        last = number == len(steps) - 1
        assert _reads(step) == [1, 2, 3] + ([] if last else [0])
        assert sorted(e for e in step if e.startswith("append")) == [
            f"append {i}" for i in range(4)
        ]
        for layer in range(3):
            # layer + 1's read is issued before layer's compute ends (its append follows it)
            assert step.index(f"read {layer + 1}") < step.index(f"append {layer}")
        if not last:
            assert step.index("read 0") > step.index("append 0")
    assert kv.steps == 2
    assert kv.open_contexts == 0


async def test_decode_keeps_the_providers_read_parallelism_in_flight(opt_tiny: OptModel) -> None:
    # Three layers ahead (four buffers): the prefill reads layers 0..2 back, each step starts
    # layer 3 at once and reads the next step's 0..2 as its own 0..2 are done, each after its
    # append. The tokens are those of one layer ahead, and of the in-memory reference.
    kv = _RecordingKV(read_parallelism=3)
    result = await opt_tiny.generate(prompts(4, 64, 1024), 3, kv)
    prefill, first, last = _phases(kv.log)
    assert sorted(_reads(prefill)) == [0, 1, 2]
    assert _reads(first)[0] == 3
    assert sorted(_reads(first)) == [0, 1, 2, 3]
    for layer in (0, 1, 2):
        assert first.index(f"read {layer}") > first.index(f"append {layer}")
    assert _reads(last) == [3]
    one_ahead = await opt_tiny.generate(prompts(4, 64, 1024), 3, _RecordingKV())
    assert torch.equal(result.tokens, one_ahead.tokens)
    reference = await opt_tiny.generate(
        prompts(4, 64, 1024), 3, memory_kv(opt_tiny, 4, 80, torch.float16)
    )
    assert torch.equal(result.tokens, reference.tokens)


async def test_stream_yields_the_generated_tokens_step_by_step(opt_tiny: OptModel) -> None:
    ids = prompts(4, 64, 1024)
    whole = await opt_tiny.generate(ids, 5, memory_kv(opt_tiny, 4, 69, torch.float16))
    kv = memory_kv(opt_tiny, 4, 69, torch.float16)
    async with contextlib.aclosing(opt_tiny.stream(ids, 5, kv)) as stream:
        steps = [token async for token in stream]
    assert torch.equal(torch.stack(steps, dim=1), whole.tokens)
    assert kv.open_contexts == 0
    assert len(whole.decode_step_s) == 4
    assert whole.prefill_s > 0
    assert whole.tokens_per_s > 0


async def test_closing_a_stream_early_releases_its_context(opt_tiny: OptModel) -> None:
    kv = memory_kv(opt_tiny, 4, 72, torch.float16)
    async with contextlib.aclosing(opt_tiny.stream(prompts(4, 64, 1024), 8, kv)) as stream:
        async for _ in stream:
            assert kv.open_contexts == 1
            break
    assert kv.open_contexts == 0


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ids", "gen_len", "match"),
    [
        (torch.zeros(4, 64, dtype=torch.int64), 0, "gen_len must be at least 1"),
        (torch.zeros(64, dtype=torch.int64), 1, r"\[batch, seq\]"),
        (torch.full((4, 64), 1024), 1, r"lie in \[0, 1024\)"),
        (torch.zeros(4, 8, dtype=torch.float32), 1, "integers"),
        (torch.zeros(1, 500, dtype=torch.int64), 13, "exceeds opt-tiny's 512 positions"),
    ],
)
async def test_bad_requests_are_refused(
    opt_tiny: OptModel, ids: torch.Tensor, gen_len: int, match: str
) -> None:
    kv = memory_kv(opt_tiny, 4, 72, torch.float16)
    with pytest.raises(ConfigError, match=match):
        await opt_tiny.generate(ids, gen_len, kv)
    assert kv.open_contexts == 0


async def test_a_cache_of_another_shape_is_refused(opt_tiny: OptModel) -> None:
    kv = memory_kv(opt_tiny, 2, 72, torch.float16)  # batch 2, the prompt has 4
    with pytest.raises(MemoryKVError, match=r"holds torch\.float16"):
        await opt_tiny.generate(prompts(4, 64, 1024), 2, kv)
    assert kv.open_contexts == 0


class _SlowLayerTwo(_Recording):
    """A cache whose layer 2 lives on the slow path (a direct layer of a store)."""

    def read_order(self, buffers: int) -> ReadAhead:
        return ReadAhead(4, buffers, slow_layers=[2])


class _SlowLayerTwoKV(_RecordingKV):
    @contextlib.asynccontextmanager
    async def context(self) -> AsyncIterator[MemoryKVContext]:  # type: ignore[override]
        yield _SlowLayerTwo(self.log, 4, 4, 80, 64, torch.float16, torch.device("cpu"))


async def test_decode_reads_in_the_caches_read_order(opt_tiny: OptModel) -> None:
    # Two buffers: layer 0 was read in the step before (or the prefill), so the slow layer 2
    # jumps ahead into the other buffer at once, 1 and 3 follow in order as buffers free, and
    # the tail reads the next step's layer 0. The tokens are those of plain layer order.
    kv = _SlowLayerTwoKV()
    result = await opt_tiny.generate(prompts(4, 64, 1024), 3, kv)
    _, first, last = _phases(kv.log)
    assert _reads(first) == [2, 1, 3, 0]
    assert _reads(last) == [2, 1, 3]
    plain = await opt_tiny.generate(prompts(4, 64, 1024), 3, _RecordingKV())
    assert torch.equal(result.tokens, plain.tokens)
