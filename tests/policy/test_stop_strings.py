"""StopStringMatcher: hand cases for each rule in its docstring, and a property test that, for any
text cut into any pieces, the released text is the same (the text up to the first stop string to
complete), is never taken back, and holds back at most `longest stop - 1` characters.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polylane.policy.scheduling.stop_strings import StopStringMatcher


def feed(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    """What each push released, then what flush released (the last item)."""
    return [matcher.push(piece) for piece in pieces] + [matcher.flush()]


def expected_output(text: str, stops: tuple[str, ...]) -> str:
    """The text up to the stop string that completes first (a streaming generation ends there);
    among stops ending at that same character, the longest one is cut (none of it is emitted)."""
    ends = [i + len(stop) for stop in stops if (i := text.find(stop)) >= 0]
    if not ends:
        return text
    end = min(ends)
    return text[: end - max(len(stop) for stop in stops if text[:end].endswith(stop))]


# ---------------------------------------------------------------------- hand cases


def test_stop_split_across_pieces_is_never_released() -> None:
    matcher = StopStringMatcher(["</s>"])
    released = feed(matcher, ["Hello <", "/", "s", "> world"])
    assert "".join(released) == "Hello "
    for part in released:
        assert "<" not in part and "/" not in part and "s>" not in part
    assert matcher.stopped


def test_text_before_a_possible_stop_is_released_at_once() -> None:
    matcher = StopStringMatcher(["xyz"])  # the last 2 characters are held back
    assert matcher.push("abcd") == "ab"
    assert matcher.push("e") == "c"
    assert matcher.push("x") == "d"
    assert matcher.push("y") == "e"  # "xy" might begin "xyz": held
    assert matcher.push("q") == "x"  # "xyq" is no stop: what cannot begin one goes out
    assert matcher.flush() == "yq"
    assert not matcher.stopped


def test_held_back_text_is_flushed_at_the_end() -> None:
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.push("ok <|en") == "o"  # the last 6 characters could begin the stop
    assert matcher.push("") == ""
    assert matcher.flush() == "k <|en"
    assert matcher.flush() == ""  # flushed once


def test_nothing_is_released_after_a_stop() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("aSTOPb") == "a"
    assert matcher.stopped
    assert matcher.push("more text") == ""
    assert matcher.flush() == ""


def test_stop_inside_one_piece_and_text_after_it() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert "".join(feed(matcher, ["line one\n\nline two"])) == "line one"


def test_multiple_stops_the_earliest_wins() -> None:
    matcher = StopStringMatcher(["STOP", "!"])
    assert "".join(feed(matcher, ["a!bSTOP"])) == "a"
    matcher = StopStringMatcher(["!", "STOP"])
    assert "".join(feed(matcher, ["aSTO", "Pb!c"])) == "a"


def test_the_stop_that_completes_first_wins_however_the_text_is_split() -> None:
    # "c" completes before "abcd" does: a stream cut char by char stops at "c", so one piece
    # holding the same text must stop there too (the output does not depend on tokenisation).
    for pieces in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"], ["abc", "d"]):
        assert "".join(feed(StopStringMatcher(["abcd", "c"]), pieces)) == "ab", pieces
    # Two stops completing at the same character: the longer one is cut whole.
    for pieces in (["xabc"], ["xa", "bc"]):
        assert "".join(feed(StopStringMatcher(["c", "abc"]), pieces)) == "x", pieces


def test_no_stops_releases_everything_immediately() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == "abc"
    assert matcher.push("d") == "d"
    assert matcher.flush() == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


# ---------------------------------------------------------------------- property


@st.composite
def text_stops_and_pieces(draw: st.DrawFn) -> tuple[str, tuple[str, ...], list[str]]:
    alphabet = "abc"  # small, so stop strings occur often and overlap
    stops = tuple(draw(st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3)))
    text = draw(st.text(alphabet, max_size=30))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    return text, stops, pieces


@settings(max_examples=400, deadline=None)
@given(text_stops_and_pieces())
def test_released_text_is_the_text_up_to_the_first_stop_for_any_split(
    case: tuple[str, tuple[str, ...], list[str]],
) -> None:
    text, stops, pieces = case
    want = expected_output(text, stops)
    hold = max((len(stop) for stop in stops), default=1) - 1
    matcher = StopStringMatcher(stops)
    released, seen = "", ""
    for piece in pieces:
        released += matcher.push(piece)
        seen += piece
        assert want.startswith(released), (released, want)  # never more, never taken back
        if not matcher.stopped:
            assert len(seen) - len(released) <= hold  # holds back no more than it must
            assert not any(stop in seen for stop in stops)
        else:
            assert released == want  # stopped as soon as a stop completed
    released += matcher.flush()
    assert released == want
    assert not any(stop in released for stop in stops)
