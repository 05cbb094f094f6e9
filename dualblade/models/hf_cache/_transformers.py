"""The transformers names the cache builds on, imported in one place that says what to install
when they are missing (``PreTrainedConfig`` is transformers 5.x's spelling)."""

try:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dualblade.models.hf_cache needs transformers 5.x: pip install 'dualblade[hf]'"
    ) from error

__all__ = ["Cache", "CacheLayerMixin", "PreTrainedConfig"]
