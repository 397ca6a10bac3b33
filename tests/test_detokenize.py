"""Incremental detokenization: the pieces of a stream join to exactly the final text, never show half of a
multi-byte character, keep every space, and never show a stop string or the text after it."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from v4engine.runtime.detokenize import REPLACEMENT, IncrementalDetokenizer, final_text, text_piece

TEXT = "hello wörld 日本語 ✓ done"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE trained on ASCII only: every non-ASCII character is split into one token per byte."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 50, trainer)
    return tokenizer


def stream(tokenizer, ids, stop=(), chunk=1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [detok.finish()]


def test_the_tokenizer_splits_multi_byte_characters(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    assert tokenizer.decode(ids) == TEXT
    assert sum(tokenizer.decode([i]) == REPLACEMENT for i in ids) >= 9, "one token per byte of 日本語 and ö"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_pieces_join_to_the_text_and_never_split_a_character(tokenizer, chunk):
    ids = tokenizer.encode(TEXT).ids
    pieces = stream(tokenizer, ids, chunk=chunk)
    assert "".join(pieces) == TEXT
    assert not any(REPLACEMENT in p for p in pieces)


def test_spaces_are_kept_at_the_start_of_a_piece(tokenizer):
    ids = tokenizer.encode("hello world the lazy dog").ids
    pieces = stream(tokenizer, ids)
    assert any(p.startswith(" ") for p in pieces) and "".join(pieces) == "hello world the lazy dog"


def test_a_stop_string_is_never_shown_even_across_pieces(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps").ids
    pieces = stream(tokenizer, ids, stop=("brown fox",))
    assert "".join(pieces) == "the quick " == final_text(tokenizer, ids, ("brown fox",))
    shown = ""
    for p in pieces:
        shown += p
        assert "b" not in shown, "text that may start the stop string is held back until it is known"


def test_held_back_text_is_released_once_it_cannot_start_a_stop_string(tokenizer):
    ids = tokenizer.encode("the quick brown dog").ids
    pieces = stream(tokenizer, ids, stop=("brown fox",))
    assert "".join(pieces) == "the quick brown dog"
    assert pieces[-1] == "", "released before the end, once 'brown d' could no longer become 'brown fox'"


def test_a_stateless_caller_gets_the_same_pieces(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    pieces = [text_piece(tokenizer, ids[:n], 1) for n in range(1, len(ids) + 1)]
    assert pieces == stream(tokenizer, ids)[:-1]


def test_a_sequence_that_ends_inside_a_character_shows_the_replacement_at_the_end(tokenizer):
    ids = tokenizer.encode("done 日").ids[:-1]             # the last byte of 日 never comes
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) and pieces[-1] == REPLACEMENT


def test_decoding_a_window_gives_the_same_pieces_as_decoding_everything(tokenizer):
    """Random ids (half characters, invalid bytes), random stop strings and chunk sizes: every piece is the one
    the stateless text_piece gives from the decode of the whole sequence."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 60))]
        text = tokenizer.decode(ids)
        stop = tuple(text[a: a + rng.randrange(1, 5)] for a in rng.sample(range(len(text)), min(2, len(text))))
        size = rng.choice([1, 2, 4])
        detok, seen = IncrementalDetokenizer(tokenizer, stop), []
        for chunk in (ids[i: i + size] for i in range(0, len(ids), size)):
            seen += chunk
            assert detok.add(chunk) == text_piece(tokenizer, seen, len(chunk), stop)
            if detok.stopped:
                break
        assert detok.finish() == text_piece(tokenizer, seen, 0, stop, final=True)
