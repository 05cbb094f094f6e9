"""An LMCache memory object's bytes as K and V rows: found without a tensor where they are
exactly whole rows, and otherwise left to the staging path."""

from __future__ import annotations

import torch

from dualblade.integrations.lmcache.objects import exact_region, kv_image, object_bytes
from dualblade.integrations.lmcache.params import ObjectGeometry

from .conftest import memory_obj, random_obj

GEOMETRY = ObjectGeometry(row_bytes=4096, max_rows=8)  # objects of up to 64 KiB


def test_an_object_of_whole_rows_is_its_own_region() -> None:
    obj = random_obj(6 * 4096, seed=3)
    region = exact_region(obj, GEOMETRY)
    assert region is not None
    assert (region.nbytes, region.rows) == (6 * 4096, 3)
    assert region.owner.data_ptr() == object_bytes(obj).data_ptr()
    # the same bytes and rows as the tensor path's K and V
    image = kv_image(object_bytes(obj), GEOMETRY, fill=False)
    assert image.staged is None
    assert image.rows == region.rows
    assert image.k.data_ptr() == region.owner.data_ptr()
    assert image.v.data_ptr() == region.owner.data_ptr() + region.nbytes // 2


def test_a_prefix_of_a_larger_tensor_is_the_objects_size() -> None:
    data = torch.zeros(64 << 10, dtype=torch.uint8)
    obj = memory_obj(data)
    obj.set_used_size(2 * 4096)  # LMCache narrows an object to the bytes it uses
    region = exact_region(obj, GEOMETRY)
    assert region is not None
    assert (region.nbytes, region.rows) == (2 * 4096, 1)


def test_what_is_not_exactly_rows_has_no_region() -> None:
    assert exact_region(random_obj(4096 + 512, seed=1), GEOMETRY) is None  # a ragged tail
    assert exact_region(random_obj(2 * 4096, seed=1, offset=1), GEOMETRY) is None  # odd start
    assert exact_region(random_obj(18 * 4096, seed=1), GEOMETRY) is None  # over object_size
    invalid = random_obj(2 * 4096, seed=1)
    invalid.invalidate()
    assert exact_region(invalid, GEOMETRY) is None
    assert exact_region(object(), GEOMETRY) is None  # no raw_data
