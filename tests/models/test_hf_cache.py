"""DualBladeCache: transformers' generate() offloads through the store and changes nothing.

Tiny random models (fixed seed, float32, built in code: no hub here) decode greedily with their
default in-memory cache and with a DualBladeCache under each policy; the ids and every step's
logits must be identical. The weights are initialised wide (std 0.3) so the generated tokens
vary from step to step: a cache that returned wrong rows would change them.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from dualblade.errors import ConfigError  # noqa: E402
from dualblade.models.hf_cache import DualBladeCache, DualBladeCacheError  # noqa: E402
from dualblade.pipeline import (  # noqa: E402
    StorageSection,
    config_from_mapping,
    layer_page_cache_bytes,
)
from dualblade.store import open_store_blocking  # noqa: E402

POLICIES = ["dual", "direct", "page-cache", "cache-policy", "baseline"]
PROMPT, NEW, BATCH, VOCAB = 7, 6, 2, 128


def _opt() -> Any:
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        ffn_dim=128,
        word_embed_proj_dim=64,
        max_position_embeddings=64,
        init_std=0.3,
    )
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(config).eval()


def _llama_gqa() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {"opt": _opt, "llama-gqa": _llama_gqa}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest) -> Any:
    built = MODELS[request.param]()
    assert built.dtype == torch.float32
    return built


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))


def _generate(model: Any, ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> Any:
    if cache is not None:
        kwargs[_cache_argument(model)] = cache
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )


def _cache_argument(model: Any) -> str:
    """transformers 5.2x calls generate's cache argument ``cache``, earlier 5.x releases
    ``past_key_values`` (still accepted later, with a FutureWarning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(output: Any) -> Any:
    return output.cache if hasattr(output, "cache") else output.past_key_values


def _storage(tmp_path: Path) -> dict[str, Any]:
    return {"direct": {"path": str(tmp_path / "direct.kv")}, "page_cache_dir": str(tmp_path / "pc")}


def _one_layer_on_page_cache(model: Any, tmp_path: Path, policy: str) -> DualBladeCache:
    """A cache whose budget (knob X) holds exactly layer 0: dual then uses both paths, and
    cache-policy keeps layer 0 and evicts the others after each use."""
    probe = DualBladeCache(model.config, PROMPT + NEW, batch_size=BATCH, policy=policy)
    layer_bytes = layer_page_cache_bytes(probe.config_for(BATCH, model.dtype))[0]
    probe.close()
    return DualBladeCache(
        model.config,
        max_cache_len=PROMPT + NEW,
        batch_size=BATCH,
        policy=policy,
        storage=_storage(tmp_path),
        pipeline={"memory": {"page_cache_budget": "4MiB", "knob_x": layer_bytes}},
    )


EXPECTED_PATHS = {
    "dual": {"direct", "page-cache"},
    "direct": {"direct"},
    "page-cache": {"page-cache"},
    "cache-policy": {"page-cache"},
    "baseline": {"baseline"},
}


@pytest.mark.parametrize("policy", POLICIES)
def test_generate_matches_the_default_cache(model, prompt, tmp_path, policy):
    reference = _generate(model, prompt)
    generated = reference.sequences[:, PROMPT:]
    assert all(len(set(row.tolist())) >= 3 for row in generated), "degenerate model: too weak"

    with _one_layer_on_page_cache(model, tmp_path, policy) as cache:
        offloaded = _generate(model, prompt, cache=cache)
        metrics = cache.metrics()
        # The store holds exactly the K and V that the in-memory cache accumulated.
        for ours, theirs in zip(cache.layers, _returned_cache(reference).layers, strict=True):
            k, v = ours.read()
            assert torch.equal(k, theirs.keys)
            assert torch.equal(v, theirs.values)

    assert torch.equal(offloaded.sequences, reference.sequences)
    for ours, theirs in zip(offloaded.logits, reference.logits, strict=True):
        assert torch.equal(ours, theirs)
    # Every decode step read its KV back from the store, through the policy's paths.
    read = {path for path, count in metrics["read_bytes"].items() if count}
    assert read == EXPECTED_PATHS[policy]
    assert cache.get_seq_length() == PROMPT + NEW - 1  # generate never caches its last token


def test_beam_search_reorders_the_stored_batch(model, prompt, tmp_path):
    reference = model.generate(prompt, max_new_tokens=NEW, num_beams=2, do_sample=False)
    with DualBladeCache(
        model.config, PROMPT + NEW, batch_size=2 * BATCH, storage=_storage(tmp_path)
    ) as cache:
        offloaded = model.generate(
            prompt,
            max_new_tokens=NEW,
            num_beams=2,
            do_sample=False,
            **{_cache_argument(model): cache},
        )
    assert torch.equal(offloaded, reference)


def test_batch_and_dtype_come_from_the_first_update(model, prompt, tmp_path):
    reference = _generate(model, prompt)
    with DualBladeCache(model.config, 32, policy="direct", storage=_storage(tmp_path)) as cache:
        assert cache.pipeline_config is None
        offloaded = _generate(model, prompt, cache=cache)
        opened = cache.pipeline_config
        assert opened is not None
        assert (opened.workload.batch, opened.model.dtype) == (BATCH, "float32")
    assert torch.equal(offloaded.sequences, reference.sequences)


def test_open_ahead_of_generate(model, prompt, tmp_path):
    reference = _generate(model, prompt)
    cache = DualBladeCache(model.config, 16, batch_size=BATCH, storage=_storage(tmp_path))
    with cache.open():
        assert cache.pipeline_config is not None
        offloaded = _generate(model, prompt, cache=cache)
    assert cache.closed
    assert torch.equal(offloaded.sequences, reference.sequences)


def _mistral_sliding() -> Any:
    """Sliding-window attention (window 4 < prompt 7): the masks, not the cache, do the window."""
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval()


def _gemma2_mixed() -> Any:
    """Alternating sliding and full layers, head_dim != hidden / heads, eager attention."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        sliding_window=4,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).eval()


@pytest.mark.parametrize("build", [_mistral_sliding, _gemma2_mixed])
def test_sliding_window_and_mixed_layer_models(build, prompt, tmp_path):
    model = build()
    reference = _generate(model, prompt)
    with _one_layer_on_page_cache(model, tmp_path, "dual") as cache:
        offloaded = _generate(model, prompt, cache=cache)
    assert torch.equal(offloaded.sequences, reference.sequences)
    # Before transformers 5.2x the default cache kept only the window of a sliding layer, so
    # attention summed over fewer (all unmasked) positions: the same values up to rounding.
    for ours, theirs in zip(offloaded.logits, reference.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_store_their_own_dtype(dtype, prompt, tmp_path):
    model = _llama_gqa().to(dtype)
    reference = _generate(model, prompt)
    with _one_layer_on_page_cache(model, tmp_path, "dual") as cache:
        offloaded = _generate(model, prompt, cache=cache)
        opened = cache.pipeline_config
        assert opened is not None
        assert opened.shape().dtype == str(dtype).removeprefix("torch.")
    assert torch.equal(offloaded.sequences, reference.sequences)
    for ours, theirs in zip(offloaded.logits, reference.logits, strict=True):
        assert torch.equal(ours, theirs)


def test_caches_in_one_shared_store(model, prompt, tmp_path):
    """A serving app opens one store and gives each request a cache of its own context."""
    reference = _generate(model, prompt)
    other = torch.flip(prompt, dims=[1])
    reference_other = _generate(model, other)
    config = DualBladeCache(model.config, PROMPT + NEW, batch_size=BATCH).config_for(BATCH)
    data = config.model_dump()
    data["storage"] = _storage(tmp_path)
    data["policy"] = "direct"
    with open_store_blocking(config_from_mapping(data, env={}), device="cpu") as store:
        first = DualBladeCache.in_store(model.config, store)
        second = DualBladeCache.in_store(model.config, store)
        with first, second:
            assert store.metrics()["open_contexts"] == 0  # contexts open on first use
            ours = _generate(model, prompt, cache=first)
            ours_other = _generate(model, other, cache=second)
            assert store.metrics()["open_contexts"] == 2
        assert store.metrics()["open_contexts"] == 0
        assert first.closed
    assert torch.equal(ours.sequences, reference.sequences)
    assert torch.equal(ours_other.sequences, reference_other.sequences)


@pytest.mark.parametrize("policy", ["dual", "direct"])
def test_caches_of_different_sizes_in_one_store(model, prompt, tmp_path, policy):
    """Requests of other batch sizes and prompt lengths share one store, none padded."""
    single = prompt[:1, : PROMPT - 3]
    reference_full = _generate(model, prompt)
    reference_single = _generate(model, single)
    config = DualBladeCache(model.config, PROMPT + NEW, batch_size=BATCH).config_for(BATCH)
    data = config.model_dump()
    data["storage"] = _storage(tmp_path)
    data["policy"] = policy
    with open_store_blocking(config_from_mapping(data, env={}), device="cpu") as store:
        full = DualBladeCache.in_store(model.config, store)
        small = DualBladeCache.in_store(
            model.config, store, batch_size=1, max_cache_len=PROMPT - 3 + NEW
        )
        with full, small:
            ours_full = _generate(model, prompt, cache=full)
            ours_single = _generate(model, single, cache=small)
            assert store.metrics()["open_contexts"] == 2
        assert store.metrics()["ledger"]["placed_bytes"] == 0
    assert torch.equal(ours_full.sequences, reference_full.sequences)
    assert torch.equal(ours_single.sequences, reference_single.sequences)


def test_a_store_for_another_shape_is_refused(model, tiny_config, tmp_path):
    config = DualBladeCache(tiny_config, 8, batch_size=1).config_for(1)
    data = config.model_dump()
    data["storage"] = _storage(tmp_path)
    with (
        open_store_blocking(config_from_mapping(data, env={}), device="cpu") as store,
        pytest.raises(DualBladeCacheError, match="the store holds 2 layers"),
    ):
        DualBladeCache.in_store(model.config, store)


# -- the cache's own operations, against transformers' DynamicCache ---------------------------


def _kv(seed: int, rows: int, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, 2, rows, 8, generator=generator)
    return k, torch.randn(batch, 2, rows, 8, generator=generator)


@pytest.fixture
def tiny_config() -> Any:
    return transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )


def test_crop_reset_and_reorder_match_dynamic_cache(tiny_config, tmp_path):
    """Assisted decoding crops, beam search reorders: the same results as in memory.

    Only what every transformers 5.x release agrees on is compared with DynamicCache (crop
    with a negative count, reorder, update); crop(0), a positive crop and reset changed meaning
    between releases and are checked against this cache's documented behaviour.
    """
    dynamic = DynamicCache()
    with DualBladeCache(tiny_config, 12, storage=_storage(tmp_path)) as cache:

        def check() -> None:
            for layer in range(2):
                assert cache.get_seq_length(layer) == dynamic.get_seq_length(layer)
                k, v = cache.layers[layer].read()
                assert torch.equal(k, dynamic.layers[layer].keys)
                assert torch.equal(v, dynamic.layers[layer].values)

        def both(op: str, *args: Any) -> None:
            if op == "update":
                for layer in range(2):
                    ours = cache.update(*args, layer)
                    theirs = dynamic.update(*args, layer)
                    assert torch.equal(ours[0], theirs[0])
                    assert torch.equal(ours[1], theirs[1])
            else:
                getattr(cache, op)(*args)
                getattr(dynamic, op)(*args)
            check()

        both("update", *_kv(0, 5))
        both("update", *_kv(1, 1))
        both("crop", -2)
        cache.crop(0)  # a no-op (generate calls it after every step on some devices)
        check()
        both("update", *_kv(2, 3))  # several rows after the prefill (chunked prefill, assistants)
        both("reorder_cache", torch.tensor([2, 0, 0]))
        both("update", *_kv(3, 1))
        assert cache.get_mask_sizes(1, 0) == (9, 0)
        assert cache.layers[0].get_mask_sizes(torch.arange(8, 9)) == (9, 0)  # early 5.x form

        cache.reset()
        assert cache.get_seq_length() == 0
        dynamic = DynamicCache()
        both("update", *_kv(4, 2))
        cache.crop(1)  # early transformers 5: the length to keep
        for layer in range(2):
            dynamic.layers[layer].keys = dynamic.layers[layer].keys[:, :, :1]
            dynamic.layers[layer].values = dynamic.layers[layer].values[:, :, :1]
        check()
        cache.crop(5)  # longer than what is held: nothing to do
        check()
        both("update", *_kv(5, 1))


# -- bad use -------------------------------------------------------------------------------------


def test_a_larger_batch_than_configured_is_refused(model, tmp_path):
    ids = torch.randint(3, VOCAB, (BATCH + 1, PROMPT), generator=torch.Generator().manual_seed(2))
    with (
        DualBladeCache(model.config, 32, batch_size=BATCH, storage=_storage(tmp_path)) as cache,
        pytest.raises(DualBladeCacheError, match=rf"batch of {BATCH + 1} .* made for {BATCH}"),
    ):
        _generate(model, ids, cache=cache)


def test_more_tokens_than_max_cache_len_are_refused(model, prompt, tmp_path):
    with (
        DualBladeCache(model.config, PROMPT + 2, storage=_storage(tmp_path)) as cache,
        pytest.raises(DualBladeCacheError, match=rf"past max_cache_len={PROMPT + 2}"),
    ):
        _generate(model, prompt, cache=cache)  # needs PROMPT + NEW - 1 rows


def test_unsupported_dtype_and_batch_changes_are_refused(tiny_config, tmp_path):
    with DualBladeCache(tiny_config, 8, storage=_storage(tmp_path)) as cache:
        k, v = _kv(0, 2)
        with pytest.raises(DualBladeCacheError, match="float64"):
            cache.update(k.double(), v.double(), 0)
        cache.update(k, v, 0)
        with pytest.raises(DualBladeCacheError, match="batch of 2"):
            cache.update(*_kv(1, 1, batch=2), 1)
        with pytest.raises(DualBladeCacheError, match="cannot change its batch"):
            cache.batch_repeat_interleave(2)


def test_kv_on_another_device_or_dtype_is_refused(tiny_config, tmp_path):
    with DualBladeCache(tiny_config, 8, device="cpu", storage=_storage(tmp_path)) as cache:
        k, v = _kv(0, 2)
        with pytest.raises(DualBladeCacheError, match="KV on meta"):
            cache.update(k.to("meta"), v.to("meta"), 0)
        cache.update(k, v, 0)
        with pytest.raises(DualBladeCacheError, match=r"KV of dtype torch\.float16"):
            cache.update(k.half(), v.half(), 1)


def test_models_without_per_token_attention_kv_are_refused(tiny_config):
    tiny_config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(DualBladeCacheError, match="linear_attention"):
        DualBladeCache(tiny_config, 8)


def test_settings_from_a_pipeline_config(tiny_config, tmp_path):
    """A whole PipelineConfig gives every section but model and workload, which are the cache's;
    policy and storage arguments win over it."""
    base = config_from_mapping(
        {
            "model": {"preset": "opt-125m"},
            "workload": {"batch": 8, "prompt_len": 256, "max_new_tokens": 16},
            "copy_threads": 3,
            "policy": "baseline",
        },
        env={},
    )
    storage = StorageSection.model_validate(_storage(tmp_path))
    cache = DualBladeCache(tiny_config, 12, pipeline=base, policy="direct", storage=storage)
    config = cache.config_for(5, torch.bfloat16)
    assert (config.copy_threads, config.policy, config.storage) == (3, "direct", storage)
    shape = config.shape()
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype) == (
        2,
        2,
        8,
        "bfloat16",
    )
    assert (config.workload.batch, config.workload.max_len) == (5, 12)
    cache.close()


def test_bad_settings_fail_at_construction(tiny_config):
    with pytest.raises(ConfigError, match="policy"):
        DualBladeCache(tiny_config, 8, policy="fastest")
    with pytest.raises(DualBladeCacheError, match="workload"):
        DualBladeCache(tiny_config, 8, pipeline={"workload": {"batch": 2}})
    with pytest.raises(DualBladeCacheError, match="max_cache_len"):
        DualBladeCache(tiny_config, 0)


def test_a_closed_cache_refuses_updates(tiny_config, tmp_path):
    cache = DualBladeCache(tiny_config, 8, storage=_storage(tmp_path))
    cache.update(*_kv(0, 2), 0)
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(DualBladeCacheError, match="closed"):
        cache.update(*_kv(1, 1), 0)
    with pytest.raises(DualBladeCacheError, match="not open"):
        cache.metrics()


# -- resources -----------------------------------------------------------------------------------


class _Resources:
    """Live Python threads and open file descriptors (what they point at) at one moment."""

    def __init__(self) -> None:
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # the descriptor listdir itself used
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        self.threads = set(threading.enumerate())
        self.names = Counter(
            [f"thread {t.name}" for t in self.threads]
            + [f"fd {fd}" for fd in fds if not fd.startswith("/proc/")]
        )

    def leaked(self, *, settle: bool = True) -> Counter[str]:
        """What is open now and was not then (other tests' threads may end meanwhile).

        With ``settle``, new anyio worker threads (the baseline's mmap copies run in them) get
        up to 5 s to finish: the event loop tells them to stop when it ends but does not join
        them, so right after close one may still be on its way out. One that stays is reported.
        """
        if settle:
            for thread in set(threading.enumerate()) - self.threads:
                if thread.name == "AnyIO worker thread":
                    thread.join(timeout=5)
        return _Resources().names - self.names


@pytest.mark.parametrize("policy", ["dual", "baseline"])
def test_close_releases_threads_files_and_storage(model, prompt, tmp_path, policy):
    before = _Resources()
    with _one_layer_on_page_cache(model, tmp_path, policy) as cache:
        _generate(model, prompt, cache=cache)
        opened = before.leaked(settle=False)
        assert any(name.startswith("thread ") for name in opened)  # the event-loop thread
        assert any(str(tmp_path) in name for name in opened)  # its target and files
        assert any((tmp_path / "pc").rglob("*"))
    assert not before.leaked()
    assert not [p for p in (tmp_path / "pc").rglob("*") if p.is_file()]  # page-cache files gone


def test_an_error_inside_generate_still_releases(model, prompt, tmp_path):
    before = _Resources()
    with (
        pytest.raises(DualBladeCacheError),
        DualBladeCache(model.config, PROMPT, storage=_storage(tmp_path)) as cache,
    ):
        _generate(model, prompt, cache=cache)
    assert cache.closed
    assert not before.leaked()


def test_an_unclosed_cache_closes_when_collected(tiny_config, tmp_path):
    before = _Resources()
    cache = DualBladeCache(tiny_config, 8, storage=_storage(tmp_path))
    cache.update(*_kv(0, 2), 0)
    assert before.leaked(settle=False)
    del cache
    assert not before.leaked()


# -- read-ahead and write-behind ---------------------------------------------------------------


def test_decode_reads_are_started_ahead_of_the_compute(model, prompt, tmp_path):
    """Every decode-step read but the very first is answered by a read started while an
    earlier layer computed; the tokens are generate()'s without offload."""
    reference = _generate(model, prompt)
    with _one_layer_on_page_cache(model, tmp_path, "dual") as cache:
        ours = _generate(model, prompt, cache=cache)
        metrics = cache.metrics()
    assert torch.equal(ours.sequences, reference.sequences)
    layers = model.config.num_hidden_layers
    reads = layers * (NEW - 1)  # each decode step reads every layer once
    assert metrics["cache_read_ahead_hits"] + metrics["cache_read_ahead_misses"] == reads
    assert metrics["cache_read_ahead_misses"] <= 1  # layer 0 of the first decode step


def test_a_failed_write_behind_is_raised_at_the_layers_next_update(model, prompt, tmp_path):
    """An append that fails behind the compute is raised at the layer's next update, before
    a row could go missing unnoticed; reads keep working."""
    from dualblade.testing import FaultKind, FaultLog, FaultPolicy, FaultyTarget, InjectedIOError

    policy = FaultPolicy(1.0, kinds=(FaultKind.EIO,), ops=("write",))
    policy.enabled = False
    config = DualBladeCache(model.config, PROMPT + NEW, batch_size=BATCH).config_for(BATCH)
    data = config.model_dump()
    data["storage"] = _storage(tmp_path)
    data["policy"] = "direct"
    with open_store_blocking(
        config_from_mapping(data, env={}),
        device="cpu",
        wrap_direct=lambda target: FaultyTarget(target, policy, log=FaultLog()),
    ) as store:
        cache = DualBladeCache.in_store(model.config, store)
        with cache:
            layer = cache.layers[0]
            geometry = (cache._backing.geometry.num_kv_heads, cache._backing.geometry.head_dim)
            states = torch.randn(BATCH, geometry[0], PROMPT, geometry[1])
            layer.update(states, states, None)
            layer.read()  # the prefill's write has landed
            policy.enabled = True  # appends fail from now on; reads do not
            row = torch.randn(BATCH, geometry[0], 1, geometry[1])
            k, _ = layer.update(row, row, None)  # answered at once, its append behind it
            assert k.shape[2] == PROMPT + 1
            with pytest.raises(InjectedIOError):
                layer.update(row, row, None)
            policy.enabled = False
