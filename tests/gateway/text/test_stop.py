from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardlm_server.gateway.text.stop import StopSequenceMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    """Per-push emitted text (flush last) and whether a stop matched."""
    matcher = StopSequenceMatcher(stops)
    out = []
    for delta in deltas:
        text, stopped = matcher.push(delta)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, matcher.stopped


def test_no_stops_is_passthrough():
    matcher = StopSequenceMatcher([])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.push("") == ("", False)
    assert matcher.flush() == ""
    assert run([""], ["a", "b"]) == (["a", "b", ""], False)  # empty stops are ignored


def test_stop_within_one_delta():
    assert run(["END"], ["hello END world"]) == (["hello "], True)


def test_stop_at_very_start():
    assert run(["###"], ["###", "more"]) == ([""], True)


def test_stop_split_over_many_deltas():
    out, stopped = run(["<|end|>"], ["Hi <", "|", "en", "d|", ">tail"])
    assert stopped and "".join(out) == "Hi "
    assert out[0] == "Hi "  # the "<" is held back, the text before it is not


def test_false_alarm_is_released():
    out, stopped = run(["\n\nUser:"], ["a\n", "\nUs", "e", "d it"])
    assert not stopped
    assert out == ["a", "", "", "\n\nUsed it", ""]


def test_held_back_text_is_flushed_at_end():
    assert run(["STOP"], ["go ST"]) == (["go ", "ST"], False)


def test_several_and_overlapping_stops():
    assert run(["abd", "bc"], ["ab", "c"]) == (["", "a"], True)  # "ab" might have been "abd"
    assert run(["ab", "abc"], ["xa", "b"]) == (["x", ""], True)
    assert run(["aab"], ["a", "a", "a", "b"]) == (["", "", "a", ""], True)


def test_earliest_start_wins_over_first_completed():
    # "User:" completes first, but "\nUser:" starts one character earlier.
    assert run(["User:", "\nUser:"], ["ok\nUser", ":"]) == (["ok", ""], True)
    # Stream ends while the longer candidate is still open: the shorter match stands.
    matcher = StopSequenceMatcher(["bc", "abcd"])
    assert matcher.push("xabc") == ("x", False)
    assert matcher.flush() == "a" and matcher.stopped


def test_unicode_stops():
    out, stopped = run(["。🙂"], ["你好", "。", "🙂再见"])
    assert stopped and "".join(out) == "你好"


def test_pushes_after_stop_are_dropped():
    matcher = StopSequenceMatcher(["x"])
    assert matcher.push("ax") == ("a", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def longest_held_suffix(text: str, stops: list[str]) -> str:
    lengths = [n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])]
    return text[len(text) - max(lengths, default=0):]


@settings(max_examples=400, deadline=None)
@given(text=st.text("ab\né🙂", max_size=30),
       stops=st.lists(st.text("ab\né🙂", max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_matches_reference(text, stops, cuts):
    starts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    expected = text[:min(starts)] if starts else text
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    deltas = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    matcher = StopSequenceMatcher(stops)
    emitted, received, stopped = "", "", False
    for delta in deltas:
        received += delta
        out, stopped = matcher.push(delta)
        emitted += out
        if stopped:
            break
        # Minimal delay: only the longest possible beginning of a stop sequence is held back
        # (even while a complete match waits on a stop sequence that might start earlier).
        held = received[len(emitted):]
        assert received.startswith(emitted)
        assert held == longest_held_suffix(received, [s for s in stops if s])
    if not stopped:
        emitted += matcher.flush()
    assert emitted == expected
    assert matcher.stopped == bool(starts)
