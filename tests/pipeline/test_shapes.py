"""Shape presets and the KV byte arithmetic the whole plan rests on (hand-computed numbers)."""

import pytest

from dualblade.errors import ConfigError
from dualblade.pipeline import PRESETS, ModelShape, get_preset


def test_opt_6_7b_paper_numbers():
    shape = get_preset("opt-6.7b")
    # 544 rows × 32 sequences × 4096 × 2 B = 136 MiB per KPU; the paper's 8.5-9.1 GB working set.
    assert shape.row_bytes(32) == 32 * 4096 * 2
    assert shape.kpu_bytes(32, 544) == 136 << 20
    assert shape.layer_kv_bytes(32, 544) == 272 << 20
    assert shape.total_kv_bytes(32, 544) == 32 * (272 << 20)


def test_gqa_shrinks_the_cache():
    llama = get_preset("Llama-3-8B")
    assert (llama.num_kv_heads, llama.head_dim, llama.dtype) == (8, 128, "bfloat16")
    assert llama.row_bytes(1) == 8 * 128 * 2
    qwen = get_preset("qwen2.5-7b")
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim) == (28, 4, 128)
    assert qwen.kpu_bytes(2, 100) == 100 * 2 * 4 * 128 * 2


def test_opt_13b_row_is_ten_kib():
    assert get_preset("opt-13b").row_bytes(1) == 10 * 1024


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_consistent(name):
    shape = PRESETS[name]
    assert shape.name == name
    assert shape.num_heads * shape.head_dim == shape.hidden_size
    assert shape.num_heads % shape.num_kv_heads == 0


def test_opt_family_layers():
    layers = {name: PRESETS[name].num_layers for name in PRESETS if name.startswith("opt")}
    assert layers == {
        "opt-tiny": 4,
        "opt-125m": 12,
        "opt-350m": 24,
        "opt-1.3b": 24,
        "opt-2.7b": 32,
        "opt-6.7b": 32,
        "opt-13b": 40,
        "opt-30b": 48,
    }


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match=r"opt-6\.7b"):
        get_preset("opt-7b")


def test_inconsistent_shape_refused():
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        ModelShape("x", 2, 64, 8, 3, 8)
    with pytest.raises(ConfigError, match="positive"):
        ModelShape("x", 0, 64, 8, 8, 8)
