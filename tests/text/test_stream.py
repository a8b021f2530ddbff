"""Incremental decoding: whole characters only, never past a stop string, never taken back."""

import pytest

from dikkat.text import ByteTokenizer
from dikkat.text.stream import TextStream

BYTES = ByteTokenizer()


def pieces(text: str, stops=()) -> tuple[list[str], TextStream]:
    stream = TextStream(BYTES, stops)
    out = []
    for token in BYTES.encode(text):
        if stream.stopped:
            break
        out.append(stream.push(token))
    out.append(stream.finish())
    return out, stream


def test_a_multibyte_character_is_released_whole():
    out, _ = pieces("aé€😀b")  # 1, 2, 3 and 4 bytes
    assert "".join(out) == "aé€😀b"
    assert "\ufffd" not in "".join(out)
    assert out[:4] == ["a", "", "é", ""]  # é's first byte alone shows nothing


def test_an_incomplete_tail_is_released_as_replacement_at_the_end():
    stream = TextStream(BYTES)
    assert stream.push(ord("x")) == "x"
    assert stream.push(0xE2) == ""  # the first of €'s three bytes
    assert stream.finish() == "\ufffd"


def test_a_stop_string_cuts_the_text_even_across_tokens():
    out, stream = pieces("hello world, bye", stops=["wor", "xyz"])
    assert "".join(out) == "hello "
    assert stream.stopped
    with pytest.raises(ValueError, match="stop string"):
        stream.push(1)


def test_text_that_may_start_a_stop_string_waits_until_it_cannot():
    stream = TextStream(BYTES, ["abc"])
    assert [stream.push(t) for t in BYTES.encode("xab")] == ["x", "", ""]
    assert stream.push(ord("d")) == "abd"  # not the stop string after all
    assert not stream.stopped


def test_the_earliest_stop_string_wins():
    out, _ = pieces("one two three", stops=["three", "two"])
    assert "".join(out) == "one "
