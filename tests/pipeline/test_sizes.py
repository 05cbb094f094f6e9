"""The one size parser: every unit, exact fractions, and refusals with a readable message."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.errors import ConfigError
from dualblade.pipeline import format_size, parse_size
from dualblade.pipeline.sizes import round_up


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("512", 512),
        ("512B", 512),
        ("64KiB", 65536),
        ("64k", 65536),
        ("64KB", 64000),
        ("1MiB", 1 << 20),
        ("4GiB", 4 << 30),
        ("4G", 4 << 30),
        ("4 gib", 4 << 30),
        ("2GB", 2_000_000_000),
        ("1.5GiB", 1610612736),
        ("0.5KiB", 512),
        ("1TiB", 1 << 40),
        (" 16 MiB ", 16 << 20),
    ],
)
def test_parses(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("lots", "is not a size"),
        ("4XB", "is not a size"),
        ("-1GiB", "is not a size"),
        ("1.3B", "whole number of bytes"),
        ("0.1KiB", "whole number of bytes"),
        (-5, "negative"),
        (True, "boolean"),
        (1.5, "a size must be"),
        (None, "a size must be"),
    ],
)
def test_refuses(value, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_size(value)


@given(st.integers(0, 1 << 40), st.sampled_from([("KiB", 1024), ("MiB", 1 << 20), ("B", 1)]))
def test_units_multiply(n, unit):
    name, factor = unit
    assert parse_size(f"{n}{name}") == n * factor


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(3 << 30) == "3.00 GiB"
    assert format_size(136 << 20) == "136.00 MiB"


@given(st.integers(0, 1 << 40), st.sampled_from([512, 4096, 65536]))
def test_round_up(value, multiple):
    rounded = round_up(value, multiple)
    assert rounded % multiple == 0
    assert value <= rounded < value + multiple
