"""Attack: stop strings that cost everyone on the shared scheduler thread.

Their count and length are bounded (at most MAX_STOP_STRINGS of at most MAX_STOP_LENGTH characters, none empty):
more is refused in one line naming `stop` (v4generate: exit status 1). Within the bounds the check after every
token decodes only a window of recent tokens: the work per token does not grow with the output. And generation
still stops exactly where the text of the whole output first holds a stop string.
"""
from __future__ import annotations

import pytest

from hostile import assert_one_line, v4generate, without_tokenizer
from v4engine.runtime.detokenize import UNSETTLED_TOKENS, IncrementalDetokenizer, final_text
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import MAX_STOP_LENGTH, MAX_STOP_STRINGS, RequestError, SamplingParams

PROMPT = "def parse_args(argv=None):\n    import argparse\n"
# the most a request may ask for, none of which the model writes
UNSEEN = tuple((f"{i:x}\u00a7" * MAX_STOP_LENGTH)[:MAX_STOP_LENGTH] for i in range(MAX_STOP_STRINGS))


class Counting:
    """A tokenizer that counts the token ids each decode call reads (the rest is the tokenizer's own: the Generator
    may first read its vocabulary, whichever test runs first on the shared generator)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, []

    def decode(self, ids, **options):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **options)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def generator(trained_engine) -> Generator:
    return Generator.from_engine_dir(trained_engine)


@pytest.mark.parametrize("stop, needle", [
    (tuple(f"s{i}" for i in range(1000)), "stop holds 1000 strings; at most 16"),
    (UNSEEN + ("one more",), "stop holds 17 strings"),
    (("x" * (MAX_STOP_LENGTH + 1),), "stop[0] has 257 characters; at most 256"),
    (("fine", ""), "stop[1] must be a non-empty string"),
    (("fine", 7), "stop[1] must be a non-empty string"),
    ("\n\n", "stop must be a list of strings"),
])
def test_too_many_too_long_or_empty_stop_strings_are_refused_in_one_line(generator, stop, needle):
    with pytest.raises(RequestError) as refused:
        generator.generate([PROMPT], SamplingParams(stop=stop))
    assert needle in str(refused.value) and "\n" not in str(refused.value)
    assert not generator.scheduler.busy, "nothing was queued"


@pytest.mark.parametrize("args, needle", [
    (["--stop", "s"] * 1000, "stop holds 1000 strings"),
    (["--stop", "x" * 300], "stop[0] has 300 characters"),
    (["--stop", ""], "stop[0] must be a non-empty string"),
])
def test_v4generate_refuses_them_in_one_line(trained_engine, args, needle):
    assert_one_line(v4generate(trained_engine, "--prompt", "def f():", *args), needle, status=1)


@pytest.mark.parametrize("length", [60, 240])
def test_the_work_per_token_does_not_grow_with_the_output(generator, length):
    counting = Counting(generator.tokenizer)
    generator.tokenizer = counting
    try:
        [result] = generator.generate([PROMPT], SamplingParams(max_new_tokens=length, ignore_eos=True, stop=UNSEEN))
    finally:
        generator.tokenizer = counting.tokenizer
    assert result.finish_reason == "length" and len(result.token_ids) == length
    *checks, whole = counting.decoded                      # the stop check per token; then the result's text
    assert whole == length
    assert max(checks) <= 2 * UNSETTLED_TOKENS, "only a window of recent tokens"
    assert sum(checks) <= 4 * length, "a few token decodes per token, at any length"


def test_the_incremental_detokenizer_decodes_a_window_per_token(generator):
    ids = generator.encode(PROMPT * 40)
    counting = Counting(generator.tokenizer)
    text = IncrementalDetokenizer(counting, UNSEEN)
    pieces = [text.add([t]) for t in ids] + [text.finish()]
    assert "".join(pieces) == generator.tokenizer.decode(ids)
    assert max(counting.decoded) <= 2 * UNSETTLED_TOKENS and sum(counting.decoded) <= 4 * len(ids)


def test_generation_stops_where_the_whole_text_first_holds_a_stop_string(generator):
    free = generator.generate([PROMPT], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    decode = generator.tokenizer.decode
    for stop in [(free.text[12:15],), (free.text[20:30], free.text[31:33]), (free.text[-3:],), UNSEEN]:
        first = next((n for n in range(1, 41) if any(s in decode(free.token_ids[:n]) for s in stop)), 40)
        [cut] = generator.generate([PROMPT], SamplingParams(max_new_tokens=40, ignore_eos=True, stop=stop))
        assert cut.token_ids == free.token_ids[:first], stop
        assert cut.text == final_text(generator.tokenizer, free.token_ids, stop), stop
        assert cut.finish_reason == ("length" if stop == UNSEEN else "stop")


def test_stop_strings_on_an_engine_without_a_tokenizer_are_refused_not_ignored(tiny_engine, tmp_path):
    generator = Generator.from_engine_dir(without_tokenizer(tiny_engine("mixed", agree=0.05)[1], tmp_path / "e"))
    with pytest.raises(RequestError, match="has no tokenizer.json, which stop strings need"):
        generator.generate([[3, 4, 5]], SamplingParams(stop=("w3",)))
