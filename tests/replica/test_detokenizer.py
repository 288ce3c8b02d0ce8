"""Incremental detokenizer on the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import random

import pytest

from kvroute.replica.detokenizer import IncrementalDetokenizer
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.checkpoint import DEFAULT_MODEL, load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids, chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids ``chunk`` at a time until a stop string matches; the deltas and the stop."""
    deltas: list[str] = []
    for i in range(0, len(ids), chunk):
        text, stop = detok.add_tokens(ids[i : i + chunk])
        deltas.append(text)
        if stop is not None:
            return deltas, stop
    return deltas, None


# ---------------------------------------------------------------- text reconstruction


def test_random_sequences_match_full_decode(tok):
    rng = random.Random(1234)
    vocab = len(tok)
    for trial in range(200):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        if trial % 5 == 0:  # sprinkle special tokens
            out[rng.randrange(len(out))] = rng.choice(tok.all_special_ids)
        skip = trial % 2 == 0
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
        deltas, stop = feed(detok, out, chunk=rng.randrange(1, 4))
        assert stop is None
        tail = detok.flush()
        assert "".join(deltas) + tail == tok.decode(out, skip_special_tokens=skip)
        assert detok.output_text == tok.decode(out, skip_special_tokens=skip)


@pytest.mark.parametrize(
    "text",
    [
        "Hello 世界! 你好，我是一个模型。",
        "emoji: 👋🏽 🇯🇵 👨‍👩‍👧 done",
        "naïve café — Ελληνικά, русский, עברית, 한국어",
        "🙂🙂🙂",
    ],
)
def test_multibyte_characters_never_split(tok, text):
    prompt = enc(tok, "Say something:")
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas, _ = feed(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert len(ids) > len(text.encode("utf-8")) / 4  # several tokens per character somewhere
    assert "" in deltas  # some token only completed part of a character: wait


def test_leading_space_of_first_token_kept(tok):
    prompt = enc(tok, "The answer is")
    ids = enc(tok, " forty two")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas, _ = feed(detok, ids)
    assert deltas[0].startswith(" ")
    assert "".join(deltas) == " forty two"


def test_special_tokens_skipped_or_shown(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = enc(tok, "Hi there") + [eos]
    shown = IncrementalDetokenizer(tok, [1, 2], SamplingParams(skip_special_tokens=False))
    hidden = IncrementalDetokenizer(tok, [1, 2], SamplingParams(skip_special_tokens=True))
    assert "".join(feed(shown, ids)[0]) + shown.flush() == "Hi there<|im_end|>"
    assert "".join(feed(hidden, ids)[0]) + hidden.flush() == "Hi there"


def test_cost_per_call_independent_of_length(tok):
    """Each decode sees a small window, never the whole prompt or output."""

    class Counting:
        def __init__(self, inner):
            self.inner, self.sizes = inner, []

        def decode(self, ids, **kw):
            self.sizes.append(len(ids))
            return self.inner.decode(ids, **kw)

    counting = Counting(tok)
    prompt = enc(tok, "word " * 2000)
    ids = enc(tok, "Long answer with 世界 and 👋🏽. " * 100)
    detok = IncrementalDetokenizer(counting, prompt, SamplingParams(stop=("never appears",)))
    feed(detok, ids)
    assert detok.output_text + detok.flush() == tok.decode(ids)
    assert max(counting.sizes) <= 16
    assert len(counting.sizes) <= 2 * len(ids) + 1


# ---------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens(tok):
    pieces = ["Hello", " wo", "rld", "!", " more"]
    ids = [i for p in pieces for i in enc(tok, p)]
    assert tok.decode(ids) == "Hello world! more"
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=("world",)))
    deltas, stop = feed(detok, ids)
    assert stop == "world"
    assert detok.output_text == "Hello " and detok.stop_str == "world"
    assert detok.flush() == ""
    # "wo" was held back: it could have been (and was) the start of "world"
    assert deltas[:2] == ["Hello", " "] and set(deltas[2:]) == {""}


def test_stop_string_included_in_output(tok):
    ids = [i for p in ["Hello", " wo", "rld", "!"] for i in enc(tok, p)]
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=("world",), include_stop_str_in_output=True))
    deltas, stop = feed(detok, ids)
    assert stop == "world" and "".join(deltas) == "Hello world"


def test_stop_string_at_first_token(tok):
    ids = enc(tok, "Hello there")
    first = tok.decode(ids[:1])
    detok = IncrementalDetokenizer(tok, enc(tok, "prompt"), SamplingParams(stop=(first,)))
    text, stop = detok.add_tokens(ids[:1])
    assert (text, stop) == ("", first)
    with pytest.raises(ValueError):
        detok.add_tokens(ids[1:])
    inc = IncrementalDetokenizer(tok, [], SamplingParams(stop=(first,), include_stop_str_in_output=True))
    assert inc.add_tokens(ids) == (first, first)  # later tokens in the same call are dropped


def test_stop_string_inside_one_token_cuts_text(tok):
    ids = enc(tok, "abcdef ghi")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=("d",)))
    text, stop = detok.add_tokens(ids)
    assert (text, stop) == ("abc", "d")


def test_held_back_prefix_released_when_impossible_and_at_flush(tok):
    params = SamplingParams(stop=("END OF",))
    detok = IncrementalDetokenizer(tok, [], params)
    assert detok.add_tokens(enc(tok, "The")) == ("The", None)
    assert detok.add_tokens(enc(tok, " EN")) == (" ", None)  # "EN" held back
    assert detok.add_tokens(enc(tok, "D")) == ("", None)  # "END" still a prefix
    assert detok.add_tokens(enc(tok, "ING")) == ("ENDING", None)  # no longer a prefix
    assert detok.add_tokens(enc(tok, " END")) == (" ", None)  # "END" held back again
    assert detok.flush() == "END"
    assert detok.flush() == ""
    assert detok.output_text == "The ENDING END"


def test_earliest_completing_stop_wins(tok):
    ids = enc(tok, "xx abcdef yy")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=("abcdef", "cd", "zz")))
    assert detok.add_tokens(ids) == ("xx ab", "cd")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=("bc", "abc")))
    assert detok.add_tokens(ids) == ("xx ", "abc")  # both end at "c": the longer one


def test_stop_strings_ignored_until_min_tokens(tok):
    ids = [i for p in ["stop", " here", " stop", " there"] for i in enc(tok, p)]
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=("stop",), min_tokens=2, max_tokens=10))
    deltas, stop = feed(detok, ids)
    assert stop == "stop"
    assert "".join(deltas) == "stop here "


def test_random_stops_match_oracle(tok):
    rng = random.Random(99)
    words = ["alpha", " beta", " 世界", " 👋🏽", " gamma", "!", " delta", "\n", " ab", "c"]
    for trial in range(100):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(3, 15)))
        ids = enc(tok, text)
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randrange(1, 3)):
            a = rng.randrange(len(full))
            stops.append(full[a : a + rng.randrange(1, 6)])
        if rng.random() < 0.3:
            stops.append("not in the text")
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(
            tok, [], SamplingParams(stop=tuple(stops), include_stop_str_in_output=include)
        )
        deltas, stop = feed(detok, ids, chunk=rng.randrange(1, 3))
        got = "".join(deltas) + detok.flush()
        found = [(full.find(s) + len(s), -len(s), s) for s in stops if full.find(s) >= 0]
        if not found:
            assert stop is None and got == full
            continue
        end, neg_len, s = min(found)
        assert stop == s, (full, stops)
        assert got == full[: end + neg_len] + (s if include else ""), (full, stops)
