"""Ids and their directory names: pure functions, no kernel needed."""
import pytest
from hypothesis import given, settings, strategies as st

from cgturn import ids

ids_text = st.text(min_size=1, max_size=400).filter(lambda s: s.strip() and "\x00" not in s)


@pytest.mark.parametrize("value", ["", " ", "\t\n", "\u2003"])
def test_blank_ids_are_rejected(value):
    assert ids.is_blank(value)
    with pytest.raises(ValueError, match="blank"):
        ids.validate(value, "task")


@pytest.mark.parametrize("value, message", [("a\x00b", "NUL"), ("\ud800", "UTF-8"), (5, "string")])
def test_invalid_ids_are_rejected(value, message):
    with pytest.raises(ValueError, match=message):
        ids.validate(value, "turn")


@pytest.mark.parametrize("value, name", [
    ("abc", "abc"),
    ("telegram:123/abc", "telegram:123%2Fabc"),
    (".", "%2E"),
    ("..", "%2E%2E"),
    ("cgroup.procs", "cgroup%2Eprocs"),
    ("100%", "100%25"),
    ("a~b", "a%7Eb"),
    ("é", "%C3%A9"),
])
def test_encode_examples(value, name):
    assert ids.encode(value) == name
    assert ids.decode(name) == value


def _assert_safe(name: str) -> None:
    assert name and "/" not in name and "." not in name and "\x00" not in name
    assert name not in (".", "..")
    assert len(name.encode()) <= 255
    assert not name.startswith(ids.INTERNAL_PREFIX)


@settings(max_examples=400)
@given(ids_text)
def test_every_id_maps_to_a_safe_name(value):
    _assert_safe(ids.encode(value))


@settings(max_examples=300)
@given(ids_text, ids_text)
def test_different_ids_never_share_a_name(a, b):
    if a != b:
        assert ids.encode(a) != ids.encode(b)


def test_long_ids_are_shortened_with_a_hash_and_stay_distinct():
    a, b = "x" * 10_000, "x" * 9_999 + "y"
    na, nb = ids.encode(a), ids.encode(b)
    for name in (na, nb):
        _assert_safe(name)
        assert "~" in name and ids.decode(name) is None
    assert na != nb


def test_a_shortened_name_never_equals_an_unshortened_one():
    long_id = "q" * 300
    short = ids.encode(long_id)
    # Any id whose plain encoding would look like `short` must contain '~', which is always encoded.
    assert ids.encode(short) != short


def test_fresh_turn_ids_are_unique_and_valid():
    made = {ids.new_turn_id() for _ in range(200)}
    assert len(made) == 200
    for value in made:
        ids.validate(value, "turn")
