"""Sizes as people write them (``vsdk submit --memory``) and as ``vsdk status`` shows them."""

from __future__ import annotations

import pytest

from vpool import sizes
from vpool.sizes import format_size, parse_size

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1073741824", GiB),
        ("512M", 512 * MiB),
        ("512m", 512 * MiB),
        ("512MB", 512 * MiB),
        ("512MiB", 512 * MiB),
        ("512 mib", 512 * MiB),
        ("2G", 2 * GiB),
        ("2g", 2 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("1.5G", 3 * GiB // 2),
        (".5G", GiB // 2),
        ("2.G", 2 * GiB),
        ("64K", 64 * KiB),
        ("1T", TiB),
        ("1P", 1024 * TiB),
        ("100B", 100),
        ("100b", 100),
        (" 3G ", 3 * GiB),
        ("0.3K", 307),  # fractions of a byte are dropped
        ("00012M", 12 * MiB),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "G",
        "abc",
        "-1G",
        "+1G",
        "1.5.3G",
        "1e9",
        "inf",
        "nan",
        "2X",
        "2GG",
        "2iB",
        "2 G B",
        "1,5G",
        "0x10",
        "1_000",
        "2Gi",
        "\uff12G",  # a full-width digit
    ],
)
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (KiB, "1 KiB"),
        (256 * MiB, "256 MiB"),
        (GiB, "1 GiB"),
        (3 * GiB // 2, "1.5 GiB"),
        (GiB + GiB // 3, "1.33 GiB"),
        (2 * TiB, "2 TiB"),
        (2**50, "1 PiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


def test_a_formatted_size_parses_back() -> None:
    for n in (KiB, 256 * MiB, 3 * GiB // 2, 2 * TiB):
        assert parse_size(format_size(n).replace(" ", "")) == n


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90.0), ("30m", 1800.0), (" 12H ", 43200.0), ("1.5d", 129600.0)]
)
def test_durations_as_people_write_them(text: str, seconds: float) -> None:
    assert sizes.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "7 days", "-1h", "1e9", "²h", "9" * 12])
def test_what_is_not_a_duration_says_so(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration such as 30m, 12h, 7d or 2w"):
        sizes.parse_duration(text)
