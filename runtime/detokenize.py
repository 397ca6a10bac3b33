"""Text of a growing token sequence, released in pieces that join to exactly the final text.

Decoding each chunk of new tokens on its own goes wrong in two ways: a byte-level BPE token may hold only part
of a multi-byte UTF-8 character (the chunk then decodes to U+FFFD), and some decoders drop the leading space of
the first token they see. So a piece is always cut from the decode of the whole sequence: the text after what
earlier pieces released. Until the sequence is final, a piece also holds back
- a trailing U+FFFD: the decoder's mark for bytes that may still become a character;
- a tail that may be the start of a stop string, because a stop string cuts the text where it begins (the
  runtime stops generating as soon as one appears, and the text ends before it).
Because what was held back is released by a later piece, the pieces join to `final_text(...)`.

A stateless caller (Triton's postprocessing step sees every response on its own) gets its piece from
`text_piece`, which decodes the sequence before and after the new tokens; the stateful IncrementalDetokenizer
(`v4generate --stream`) remembers what it released and decodes once per piece. The tokenizers library decodes
thousands of tokens in well under a millisecond.
"""
from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """(text before the first stop string, whether one was found)."""
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def releasable(text: str, stop: Sequence[str], final: bool) -> str:
    """The part of `text` (the decode of every token so far) that no later token can change."""
    text, stopped = cut_at_stop(text, stop)
    if stopped or final:
        return text
    if text.endswith(REPLACEMENT):
        text = text[:-1]
    for held in range(min(len(text), max((len(s) for s in stop), default=1) - 1), 0, -1):
        if any(s.startswith(text[-held:]) for s in stop):
            return text[:-held]
    return text


def final_text(tokenizer, ids: Sequence[int], stop: Sequence[str] = ()) -> str:
    """The text of a finished sequence: its decode, ending before the first stop string."""
    return releasable(tokenizer.decode(list(ids)), stop, final=True)


def text_piece(tokenizer, ids: Sequence[int], new: int, stop: Sequence[str] = (), final: bool = False) -> str:
    """The text that the last `new` of `ids` release, given that pieces were released for the tokens before them.

    `final`: the sequence ends here; release everything (held-back tails included)."""
    ids = list(ids)
    before = releasable(tokenizer.decode(ids[: len(ids) - new]), stop, final=False)
    return releasable(tokenizer.decode(ids), stop, final)[len(before):]


class IncrementalDetokenizer:
    """Feed the token ids of each step with `add`; every call returns the text they release; `finish` flushes.

        detok = IncrementalDetokenizer(tokenizer, stop=("\\n\\n",))
        for chunk in generator.stream(prompt, params):
            print(detok.add(chunk), end="")
        print(detok.finish())
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.released = 0                                   # characters of the text released so far

    def add(self, ids: Sequence[int]) -> str:
        self.ids += [int(t) for t in ids]
        return self._release(final=False)

    def finish(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = releasable(self.tokenizer.decode(self.ids), self.stop, final)
        piece, self.released = text[self.released:], len(text)
        return piece
