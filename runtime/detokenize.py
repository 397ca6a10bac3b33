"""Text of a growing token sequence, released in pieces that join to exactly the final text.

Decoding each chunk of new tokens on its own goes wrong in two ways: a byte-level BPE token may hold only part
of a multi-byte UTF-8 character (the chunk then decodes to U+FFFD), and some decoders drop the leading space of
the first token they see. So a piece is always cut from the text of the whole sequence: the text after what
earlier pieces released. Until the sequence is final, a piece also holds back
- a trailing U+FFFD: the decoder's mark for bytes that may still become a character;
- a tail that may be the start of a stop string, because a stop string cuts the text where it begins (the
  runtime stops generating as soon as one appears, and the text ends before it).
Because what was held back is released by a later piece, the pieces join to `final_text(...)`; and because
every place where a stop string may begin was held back, a new one can only begin in unreleased text.

A stateless caller (Triton's postprocessing step sees every response on its own) gets its piece from
`text_piece`, which decodes the sequence before and after the new tokens. The IncrementalDetokenizer
(`v4generate --stream`, and the runtime's stop-string check after every token) does a bounded amount of work per
token, however long the text grows: like vLLM's detokenizer it decodes only a window of recent tokens, and it
searches for stop strings only in the text it has not released.
"""
from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"
UNSETTLED_TOKENS = 16       # see IncrementalDetokenizer.add


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """(text before the first stop string, whether one was found)."""
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the start of a stop string (the longest such end)."""
    held = 0
    for s in filter(None, stop):
        i = text.find(s[0], max(len(text) - len(s) + 1, 0))       # ends shorter than s that begin as s does
        while i != -1 and len(text) - i > held:
            if s.startswith(text[i:]):
                held = len(text) - i
                break
            i = text.find(s[0], i + 1)
    return held


def releasable(text: str, stop: Sequence[str], final: bool) -> tuple[str, bool]:
    """(the start of `text` that no later token can change, whether a stop string ends the text there).

    `text` is the sequence's text from any point that no stop string begins before: all of it, or what earlier
    pieces did not release."""
    text, stopped = cut_at_stop(text, stop)
    if stopped or final:
        return text, stopped
    if text.endswith(REPLACEMENT):
        text = text[:-1]
    return text[: len(text) - held_back(text, stop)], False


class SpecialTokensKept:
    """`tokenizer` whose decode keeps special tokens: a chat answer's text as its parser must see it (V4's </think>
    and DSML markers may be special tokens, which a plain decode drops)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def final_text(tokenizer, ids: Sequence[int], stop: Sequence[str] = ()) -> str:
    """The text of a finished sequence: its decode, ending before the first stop string."""
    return releasable(tokenizer.decode(list(ids)), stop, final=True)[0]


def text_piece(tokenizer, ids: Sequence[int], new: int, stop: Sequence[str] = (), final: bool = False) -> str:
    """The text that the last `new` of `ids` release, given that pieces were released for the tokens before them.

    `final`: the sequence ends here; release everything (held-back tails included)."""
    ids = list(ids)
    before, _ = releasable(tokenizer.decode(ids[: len(ids) - new]), stop, final=False)
    return releasable(tokenizer.decode(ids), stop, final)[0][len(before):]


class IncrementalDetokenizer:
    """Feed the token ids of each step with `add`; every call returns the text they release; `finish` flushes.

        detok = IncrementalDetokenizer(tokenizer, stop=("\\n\\n",))
        for chunk in generator.stream(prompt, params):
            print(detok.add(chunk), end="")
        print(detok.finish())

    `stopped` turns true with the first call whose text holds a stop string (the text ends before it; later
    calls release nothing). Only a window is decoded, so the pieces are exactly text_piece's for decoders whose
    text for a token depends only on the tokens just before it: byte-level BPE (DeepSeek's) always; Metaspace
    and WordPiece unless those tokens are special ones, which decode to nothing.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.stopped = False
        self._window: list[int] = []     # the ids from the prefix offset on: context, then the unsettled tokens
        self._read = 0                   # how many of them come before the read offset (their text is settled)
        self._text = ""                  # the sequence's text from a point at or before the first unreleased
        self._settled = 0                # characters of _text up to the read offset: no later token changes them
        self._released = 0               # characters of _text released

    def add(self, ids: Sequence[int]) -> str:
        """The text these ids release. Their text is the window's decode past its context's: the context makes
        spaces come out as in the whole text. While the text ends in U+FFFD, the read offset stays (the bytes may
        still become a character); it moves past a run of more than UNSETTLED_TOKENS such tokens all the same,
        which no character is long enough to span (unless most of those tokens decode to nothing)."""
        if self.stopped:
            return ""
        self._window += [int(t) for t in ids]
        context = self.tokenizer.decode(self._window[: self._read])
        text = self.tokenizer.decode(self._window)
        self._text = self._text[: self._settled] + text[len(context):]
        if not text.endswith(REPLACEMENT) or len(self._window) - self._read > UNSETTLED_TOKENS:
            self._window = self._window[self._read:]           # the prefix offset moves to the old read offset
            self._read, self._settled = len(self._window), len(self._text)
        piece = self._release(final=False)
        done = min(self._released, self._settled)              # released and settled: no later call needs it
        self._text, self._settled, self._released = self._text[done:], self._settled - done, self._released - done
        return piece

    def finish(self) -> str:
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        piece, self.stopped = releasable(self._text[self._released:], self.stop, final)
        self._released += len(piece)
        return piece
