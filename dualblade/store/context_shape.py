"""A context's own shape: its batch, its maximum length and its dtype, within the store's.

A serving app opens one store and gives each request a context of the request's own shape,
instead of padding every request to one batch and one prompt length. The store's workload is
the default and the largest shape: the copy threads' pinned buffers hold one KPU of it, and a
context's KPUs must fit there. Each context gets a plan of its own (its layers' sizes, its
extents and files) under the store's current budget.
"""

from __future__ import annotations

import dataclasses

from dualblade.errors import ConfigError
from dualblade.pipeline import PipelineConfig, config_for_model
from dualblade.pipeline import pin_bytes as kpu_buffer_bytes
from dualblade.store.errors import KVShapeError


def context_config(
    config: PipelineConfig,
    buffer_bytes: int,
    *,
    batch: int | None,
    max_len: int | None,
    dtype: str | None,
) -> PipelineConfig:
    """The config of a context of this shape (None: the store's); the store plans it under
    the context's share of the budget.

    Raises:
        KVShapeError: a value that is not positive, a dtype the store cannot hold, or a shape
            whose KPU is larger than the copy threads' ``buffer_bytes``.
    """
    workload = config.workload
    shape = config.shape()
    want_batch = workload.batch if batch is None else batch
    want_len = workload.max_len if max_len is None else max_len
    for name, value in (("batch", want_batch), ("max_len", want_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KVShapeError(f"a context's {name} must be a positive int, got {value!r}")
    try:
        shaped = config_for_model(
            config,
            dataclasses.replace(shape, dtype=shape.dtype if dtype is None else dtype),  # type: ignore[arg-type]
            batch=want_batch,
            prompt_len=want_len,
            max_new_tokens=0,
            source="the context's shape",
        )
    except ConfigError as error:
        raise KVShapeError(str(error)) from None
    needed = kpu_buffer_bytes(shaped)
    if needed > buffer_bytes:
        raise KVShapeError(
            f"a context of batch {want_batch}, {want_len} rows of {shaped.shape().dtype} "
            f"has {needed}-byte KPUs; this store's copy threads hold {buffer_bytes} bytes (its "
            f"workload: batch {workload.batch}, {workload.max_len} rows): open the store with "
            "the largest shape its contexts will have"
        )
    return shaped
