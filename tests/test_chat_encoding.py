"""The V4 chat encoding reproduces the checkpoint encoder's worked examples byte for byte, and the answer parser
reads back what the encoder writes (reasoning, content, tool calls), streamed or whole."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from v4engine.chat.encoding import (BOS, EFFORT_PROFILES, EOS, ChatError, encode_messages)
from v4engine.chat.parsing import AnswerParser, ToolCall, parse_answer, parse_tool_block
from v4engine.runtime.sampling import RequestError

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a specific location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
        "required": ["location"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web for information",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "Search query"},
        "num_results": {"type": "integer", "description": "Number of results to return"}},
        "required": ["query"]}}}


def test_chat_mode_ends_the_prompt_with_a_closed_thinking_block():               # E1
    messages = [SYSTEM, {"role": "user", "content": "Hello"}]
    assert encode_messages(messages, thinking=False) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>")
    history = messages + [{"role": "assistant", "content": "Hi!"}]
    assert encode_messages(history, thinking=False) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi!"
        "<｜end▁of▁sentence｜>")


def test_thinking_mode_opens_the_reasoning_and_efforts_prepend_their_text():      # E2
    messages = [SYSTEM, {"role": "user", "content": "What is 2+2?"}]
    tail = "You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>"
    assert encode_messages(messages, thinking=True) == BOS + tail
    assert encode_messages(messages, thinking=True, reasoning_effort="low") == BOS + tail
    high = encode_messages(messages, thinking=True, reasoning_effort="high")
    assert high == BOS + EFFORT_PROFILES["0731"]["high"] + tail
    assert high.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    maximum = encode_messages(messages[1:], thinking=True, reasoning_effort="max")
    assert maximum == (BOS + "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
                       + EFFORT_PROFILES["0731"]["max"].split("\n", 1)[1] + "<｜User｜>What is 2+2?<｜Assistant｜><think>")
    # the preview encoder: high renders nothing, max is 0731's high text; chat mode never has a prefix
    assert encode_messages(messages, thinking=True, reasoning_effort="high", profile="preview") == BOS + tail
    assert encode_messages(messages, thinking=True, reasoning_effort="max", profile="preview") == high
    assert encode_messages(messages, thinking=False, reasoning_effort="max").startswith(BOS + "You are")


def test_an_effort_the_release_does_not_know_is_refused_with_its_choices():
    with pytest.raises(ChatError, match=r"reasoning_effort must be one of low, high, max for the 0731 encoding"):
        encode_messages([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="xhigh")
    with pytest.raises(ChatError, match=r"one of high, max for the preview encoding \(got 'low'\)"):
        encode_messages([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="low",
                        profile="preview")


def test_earlier_reasoning_is_dropped_and_earlier_turns_close_their_thinking():    # E3
    messages = [SYSTEM, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there! How can I help you?",
                 "reasoning_content": "The user said hello, I should greet back."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris.",
                 "reasoning_content": "The user asks about the capital of France. It is Paris."}]
    assert encode_messages(messages, thinking=True) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I "
        "help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks "
        "about the capital of France. It is Paris.</think>The capital of France is Paris.<｜end▁of▁sentence｜>")
    assert encode_messages(messages[:-1], thinking=True).endswith("France?<｜Assistant｜><think>")
    # vLLM's key for the reasoning is accepted too, and dropped the same way
    renamed = [{**m, "reasoning": m.pop("reasoning_content")} if "reasoning_content" in m else m for m in
               [dict(m) for m in messages]]
    assert encode_messages(renamed, thinking=True) == encode_messages(messages, thinking=True)


E4_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}
{"name": "search", "description": "Search the web for information", "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "Search query"}, "num_results": {"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
E4_CALL = """

<｜DSML｜tool_calls>
<｜DSML｜invoke name="get_weather">
<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>
<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls>"""
E4_MESSAGES = [
    {**SYSTEM, "tools": [WEATHER, SEARCH]},
    {"role": "user", "content": "What's the weather in Beijing?"},
    {"role": "assistant", "content": "",
     "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
     "tool_calls": [{"id": "call_001", "type": "function", "function": {
         "name": "get_weather", "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_001",
     "content": "{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}"},
    {"role": "assistant", "reasoning_content": "Got the weather data. Let me format a nice response.",
     "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."}]


def test_tools_a_call_and_its_result_keep_every_reasoning():                     # E4
    expected = ("<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n" + E4_TOOLS_SECTION
                + "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in "
                "Beijing. I should use the get_weather tool.</think>" + E4_CALL + "<｜end▁of▁sentence｜><｜User｜>"
                "<tool_result>{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}</tool_result>"
                "<｜Assistant｜><think>Got the weather data. Let me format a nice response.</think>The weather in "
                "Beijing is currently sunny with a temperature of 22°C and 45% humidity.<｜end▁of▁sentence｜>")
    assert len(expected) == 2281                       # the fixture's length with LF line ends
    assert encode_messages(E4_MESSAGES, thinking=True) == expected
    # arguments given as an object (clients replaying them) render the same
    as_dict = json.loads(json.dumps(E4_MESSAGES))
    as_dict[2]["tool_calls"][0]["function"]["arguments"] = {"location": "Beijing", "unit": "celsius"}
    assert encode_messages(as_dict, thinking=True) == expected


def test_parallel_results_follow_the_calls_order_and_non_strings_are_json():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"n": 3, "l": [1, 2]}}},
             {"id": "b", "type": "function", "function": {"name": "now", "arguments": ""}}]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a",
                                                                         "content": "A"}]
    prompt = encode_messages(messages, thinking=False)
    assert ('<｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="l" string="false">[1, 2]</｜DSML｜parameter>') in prompt
    assert '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>' in prompt
    assert prompt.endswith("<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
                           "<｜Assistant｜></think>")


def test_a_task_and_a_latest_reminder():                                          # E5
    messages = [{"role": "system", "content": "System text."},
                {"role": "latest_reminder", "content": "2026-07-31,Friday,Paris,App,English"},
                {"role": "user", "content": "Which day?", "task": "action"}]
    assert encode_messages(messages, thinking=False) == (
        "<｜begin▁of▁sentence｜>System text.<｜latest_reminder｜>2026-07-31,Friday,Paris,App,English<｜User｜>Which "
        "day?<｜Assistant｜></think><｜action｜>")
    answered = messages + [{"role": "assistant", "content": "Search", "reasoning_content": "ignored"}]
    assert encode_messages(answered, thinking=True).endswith(
        "<｜User｜>Which day?<｜Assistant｜><think><｜action｜>Search<｜end▁of▁sentence｜>")   # no thinking part
    query = [{"role": "user", "content": "Find news about X", "task": "query"}]
    assert encode_messages(query, thinking=False) == BOS + "<｜User｜>Find news about X<｜query｜>"


def test_an_unfinished_assistant_turn_is_continued():                             # E6
    messages = [{"role": "user", "content": "Please write quick sort code"},
                {"role": "assistant", "content": "```python\n", "wo_eos": True}]
    assert encode_messages(messages, thinking=False) == (
        BOS + "<｜User｜>Please write quick sort code<｜Assistant｜></think>```python\n")
    assert encode_messages(messages, thinking=True) == (
        BOS + "<｜User｜>Please write quick sort code<｜Assistant｜><think></think>```python\n")


def test_content_parts_are_joined_and_other_parts_refused():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert encode_messages([{"role": "user", "content": parts}], thinking=False) == (
        BOS + "<｜User｜>a\n\nb<｜Assistant｜></think>")
    with pytest.raises(ChatError, match=r"messages\[0\]\.content\[1\]: only text parts are supported"):
        encode_messages([{"role": "user", "content": [parts[0], {"type": "image_url"}]}], thinking=False)


@pytest.mark.parametrize("messages, fault", [
    ([], "messages must be a non-empty list"),
    ("hello", "messages must be a non-empty list"),
    ([["user", "x"]], r"messages\[0\] must be an object"),
    ([{"role": "wizard", "content": "x"}], r"messages\[0\]\.role must be one of"),
    ([{"role": "developer", "content": ""}], r"messages\[0\]: a developer message needs content"),
    ([{"role": "user", "content": "x", "task": "fly"}], r"messages\[0\]\.task must be one of"),
    ([{"role": "user", "content": 7}], r"messages\[0\]\.content must be a string or a list of text parts"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": "f"}]}],
     r"messages\[1\]\.tool_calls\[0\]\.function must be an object with a string name"),
    ([{"role": "system", "content": "x", "tools": ["f"]}], r"messages\[0\]\.tools must be a list"),
    ([{"role": "tool", "content": "x", "tool_call_id": ["a"]}], r"messages\[0\]\.tool_call_id must be a string"),
])
def test_messages_that_cannot_be_rendered_are_refused_naming_the_field(messages, fault):
    with pytest.raises(ChatError, match=fault):
        encode_messages(messages, thinking=False)


# --------------------------------------------------------------------------- the parser
def test_a_thinking_answer_parses_into_reasoning_and_content():
    message = parse_answer("Simple arithmetic.</think>2 + 2 = 4." + EOS, thinking=True)
    assert (message.reasoning, message.content, message.tool_calls) == ("Simple arithmetic.", "2 + 2 = 4.", [])
    cut = parse_answer("Still thinking", thinking=True)          # cut by max_tokens: all reasoning, no content
    assert (cut.reasoning, cut.content) == ("Still thinking", None)
    chat = parse_answer("2 + 2 = 4.", thinking=False)
    assert (chat.reasoning, chat.content) == (None, "2 + 2 = 4.")


def test_tool_calls_round_trip_through_the_encoder_and_the_parser():
    rendered = encode_messages(E4_MESSAGES[:3], thinking=True)
    answer = rendered.split("<｜Assistant｜><think>")[-1]          # what the model wrote for the call
    message = parse_answer(answer, thinking=True)
    assert message.reasoning == E4_MESSAGES[2]["reasoning_content"]
    assert message.content == ""
    assert message.tool_calls == [ToolCall("get_weather", '{"location": "Beijing", "unit": "celsius"}')]
    mixed = encode_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "Let me see.",
                             "tool_calls": [{"function": {"name": "f", "arguments": {"n": 3, "s": "a\nb"}}},
                                            {"function": {"name": "now", "arguments": {}}}]}], thinking=False)
    message = parse_answer(mixed.split("</think>", 1)[1], thinking=False)
    assert message.content == "Let me see."
    assert message.tool_calls == [ToolCall("f", '{"n": 3, "s": "a\\nb"}'), ToolCall("now", "{}")]
    assert json.loads(message.tool_calls[0].arguments) == {"n": 3, "s": "a\nb"}


def test_a_block_that_breaks_the_grammar_stays_text():
    broken = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\noops</｜DSML｜tool_calls>"
    assert parse_tool_block(broken.lstrip("\n")) is None
    message = parse_answer("Answer." + broken, thinking=False)
    assert message.tool_calls == [] and message.content == "Answer." + broken.lstrip("\n")
    twice = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">1'
             '</｜DSML｜parameter>\n<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '</｜DSML｜tool_calls>')
    assert parse_tool_block(twice) is None


@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_deltas_join_to_the_whole_message_however_the_text_is_cut(thinking):
    rendered = encode_messages(E4_MESSAGES[:3], thinking=True)
    answer = rendered.split("<｜Assistant｜><think>")[-1].removesuffix(EOS)      # the runtime's text has no EOS
    if not thinking:
        answer = "Before." + answer.split("</think>", 1)[1]
    whole = parse_answer(answer, thinking=thinking)
    for size in (1, 2, 3, 7, 50):
        parser = AnswerParser(thinking)
        deltas = [parser.feed(answer[i: i + size]) for i in range(0, len(answer), size)] + [parser.finish()]
        assert "".join(d.reasoning for d in deltas) == (whole.reasoning or "")
        assert "".join(d.content for d in deltas) == (whole.content or "")
        assert [c for d in deltas for c in d.tool_calls] == whole.tool_calls
        assert all("｜DSML｜" not in d.content + d.reasoning for d in deltas)   # no marker leaks as text


# --------------------------------------------------------------------------- v4generate --messages
def v4generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v4engine.runtime.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_v4generate_shows_the_encoded_prompt_without_opening_an_engine(tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": E4_MESSAGES[1:2], "tools": [WEATHER]}), encoding="utf-8")
    shown = v4generate(str(tmp_path / "no-engine"), "--messages", str(chat), "--thinking", "--reasoning-effort",
                       "high", "--show-prompt")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == encode_messages([{"role": "system", "content": "", "tools": [WEATHER]}, E4_MESSAGES[1]],
                                           thinking=True, reasoning_effort="high")
    chat.write_text(json.dumps([{"role": "wizard"}]))
    refused = v4generate(str(tmp_path / "no-engine"), "--messages", str(chat), "--show-prompt")
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"v4generate: error: --messages {chat}: messages[0].role must be one of system, " \
                                     "user, assistant, tool, developer, latest_reminder (got 'wizard')"
    alone = v4generate(str(tmp_path / "no-engine"), "--prompt", "x", "--show-prompt")
    assert alone.returncode == 1 and "go with --messages" in alone.stderr


# --------------------------------------------------------------------------- the release's encoder
def test_the_profiles_are_the_engine_formats_and_a_checkpoints_encoder_names_its_own():
    from v4engine.chat.encoding import profile_of_encoder
    from v4engine.contract.engine import CHAT_PROFILES

    assert tuple(EFFORT_PROFILES) == CHAT_PROFILES
    assert profile_of_encoder('REASONING_EFFORT_PROMPTS = {"low": "", "high": ...}') == "0731"
    assert profile_of_encoder('REASONING_EFFORT_MAX = ("Reasoning Effort: ...")') == "preview"
    assert profile_of_encoder("def encode_messages(...): ...") is None


def test_an_engine_records_its_checkpoints_encoder_and_the_chat_paths_render_its_efforts(tiny_checkpoint, tmp_path):
    import shutil

    from v4engine.builder.build import BuildOptions, build
    from v4engine.runtime import Generator

    checkpoint = Path(shutil.copytree(tiny_checkpoint("mixed", names="hf"), tmp_path / "ckpt"))
    (checkpoint / "encoding").mkdir()
    (checkpoint / "encoding" / "encoding_dsv4.py").write_text('REASONING_EFFORT_MAX = ("Reasoning Effort: ...")\n')
    manifest = build(BuildOptions(checkpoint=checkpoint, output=tmp_path / "engine", mtp=3, progress=False))
    assert manifest.chat_profile == "preview"
    assert json.loads((tmp_path / "engine" / "engine.json").read_text())["chat_profile"] == "preview"
    generator = Generator.from_engine_dir(tmp_path / "engine")
    chat = generator.chat([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="max")
    assert chat.prompt == encode_messages([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="max",
                                          profile="preview")
    with pytest.raises(RequestError, match="for the preview encoding"):
        generator.chat([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="low")
