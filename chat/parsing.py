"""DeepSeek-V4's answer, parsed back: reasoning, content and tool calls, whole or as it streams.

In thinking mode the prompt ends with `<think>`, so the answer starts inside the reasoning and `</think>` ends it;
in chat mode it starts in the content. Tool calls follow the content as one DSML block (chat/encoding.py writes
the same block for earlier turns):

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A parameter with string="true" is text taken as is; string="false" is JSON. Arguments come back as the JSON object
string OpenAI clients expect, keys in the order written.

The parser is lenient where the checkpoint's reference parser raises (a server must answer whatever the model
wrote): no `</think>` means everything is reasoning and there is no content; a tool block that does not follow
the grammar stays in the content as text. Whole answers are parsed by feeding them to the same streaming parser
(`parse_answer`), so streamed deltas join to exactly the non-streamed message.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .encoding import BOS, DSML, END_THINK, EOS, THINK, TOOL_CALLS_BLOCK, TOOL_CALLS_END, to_json

_INVOKE = re.compile(f'<{DSML}invoke name="([^"\\n]*)">\\n')
_PARAMETER = re.compile(f'<{DSML}parameter name="([^"\\n]*)" string="(true|false)">(.*?)</{DSML}parameter>\\n',
                        re.S)
_INVOKE_END = f"</{DSML}invoke>\n"
_SEPARATOR = "\n\n"                                   # between the content and a tool block


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                                    # a JSON object, as text


@dataclass
class Delta:
    """What one piece of streamed text adds to the message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class AssistantMessage:
    reasoning: str | None                             # None in chat mode
    content: str | None                               # None when the answer never left its reasoning
    tool_calls: list[ToolCall]


def parse_tool_block(block: str) -> list[ToolCall] | None:
    """The calls of a DSML block (from `<｜DSML｜tool_calls>` through its end tag), or None if it does not follow
    the grammar: each invoke on its own lines, parameters one per line, no parameter name twice."""
    if not (block.startswith(TOOL_CALLS_BLOCK + "\n") and block.endswith(TOOL_CALLS_END)):
        return None
    at, end, calls = len(TOOL_CALLS_BLOCK) + 1, len(block) - len(TOOL_CALLS_END), []
    while at < end:
        invoke = _INVOKE.match(block, at)
        if invoke is None:
            return None
        at, arguments = invoke.end(), {}
        while (parameter := _PARAMETER.match(block, at)) is not None:
            name, is_string, value = parameter.groups()
            if name in arguments:
                return None
            arguments[name] = to_json(value) if is_string == "true" else _json_value(value)
            at = parameter.end()
        if not arguments and block.startswith("\n", at):        # an invoke without parameters has a blank line
            at += 1
        if not block.startswith(_INVOKE_END, at):
            return None
        at += len(_INVOKE_END)
        text = "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in arguments.items()) + "}"
        calls.append(ToolCall(invoke.group(1), text))
    return calls if at == end and calls else None


def _json_value(value: str) -> str:
    """A string="false" value as JSON text: as written when it is JSON, else as a JSON string."""
    try:
        json.loads(value)
    except ValueError:
        return to_json(value)
    return value


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin one of `markers` (the longest such end)."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1)
                if m.startswith(text[len(text) - n:])), default=0)


class AnswerParser:
    """Feed the answer's text as it grows (`feed`), then `finish`: each returns the Delta that text settles.

    Text that may still turn out to begin `</think>` or a tool block is held back until it is known."""

    def __init__(self, thinking: bool):
        self.mode = "reasoning" if thinking else "content"
        self._pending = ""                            # text not yet given out
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> Delta:
        self._pending += text
        return self._settle(final=False)

    def finish(self) -> Delta:
        delta = self._settle(final=True)
        if self.mode == "tool":                       # a block that never ended is text after all
            delta.content += self._pending
        elif self.mode == "reasoning":
            delta.reasoning += self._pending
        else:
            delta.content += self._pending
        self._pending = ""
        return delta

    def _settle(self, final: bool) -> Delta:
        delta = Delta()
        while True:
            if self.mode == "tool":
                end = self._pending.find(TOOL_CALLS_END)
                if end < 0:
                    return delta
                block = self._pending[: end + len(TOOL_CALLS_END)]
                calls = parse_tool_block(block)
                if calls is None:                     # not a tool block after all: it stays text
                    delta.content += block
                else:
                    delta.tool_calls += calls
                    self.tool_calls += calls
                self._pending, self.mode = self._pending[len(block):], "content"
                continue
            markers = (END_THINK, TOOL_CALLS_BLOCK) if self.mode == "reasoning" else (TOOL_CALLS_BLOCK,)
            found = min(((i, m) for m in markers if (i := self._pending.find(m)) >= 0), default=None)
            if found is None:             # hold back what may begin a marker, or the blank line before a block
                keep = 0 if final else _held(self._pending, (*markers, _SEPARATOR + TOOL_CALLS_BLOCK))
                self._emit(delta, self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return delta
            at, marker = found
            before = self._pending[:at]
            if marker == END_THINK:
                self._emit(delta, before)
                self._pending, self.mode = self._pending[at + len(marker):], "content"
            else:
                self._emit(delta, before.removesuffix(_SEPARATOR))
                self._pending, self.mode = self._pending[at:], "tool"

    def _emit(self, delta: Delta, text: str) -> None:
        if self.mode == "reasoning":
            delta.reasoning += text
        else:
            delta.content += text


def strip_markers(text: str) -> str:
    """The answer's text without the BOS and EOS literals a decoder that keeps special tokens writes."""
    return text.replace(BOS, "").replace(EOS, "")


def parse_answer(text: str, *, thinking: bool) -> AssistantMessage:
    """The whole answer (its text, EOS or not) as a message: exactly the streamed deltas joined."""
    parser = AnswerParser(thinking)
    deltas = [parser.feed(strip_markers(text)), parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    left_reasoning = parser.mode != "reasoning"
    return AssistantMessage(reasoning if thinking else None,
                            content if (left_reasoning or not thinking) else None,
                            [c for d in deltas for c in d.tool_calls])


__all__ = ["AnswerParser", "AssistantMessage", "Delta", "THINK", "ToolCall", "parse_answer", "parse_tool_block",
           "strip_markers"]
