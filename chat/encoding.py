"""DeepSeek-V4's chat encoding: OpenAI-style messages -> the prompt string, every special token written out.

V4 ships no Jinja chat template: its checkpoints carry a Python encoder (`encoding/encoding_dsv4.py`), and this
module renders what that encoder renders, byte for byte (tests/test_chat_encoding.py holds its worked examples).
The string is tokenized as it is, without added special tokens: BOS is part of it.

    prompt = encode_messages([{"role": "user", "content": "Hello"}], thinking=False)
    # '<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>'

The encoder's steps, in order:
1. merge: a `tool` message becomes a tool_result block of a user turn (V4 has no tool role); consecutive user and
   tool turns fuse into one user turn (unless the earlier one carries a `task`).
2. sort: a user turn's tool results follow the order of the calls of the assistant turn before it.
3. drop (thinking mode, unless any message declares tools): reasoning of assistant turns before the last user
   turn is dropped, and so are `developer` turns before it.
4. render each message: an effort prefix at message 0 (thinking mode), the role's body, then what opens the next
   turn: after a user turn, `<｜Assistant｜>` and `<think>` (thinking mode, the last user turn) or `</think>`.

Reasoning effort differs between releases (EFFORT_PROFILES): the preview encoder knows None/high/max, the 0731 one
low/high/max with other texts. A message that cannot be rendered raises ChatError naming the message and field.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from v4engine.contract.errors import V4EngineError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_BLOCK = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
TOOL_CALLS_START = "\n\n" + TOOL_CALLS_BLOCK           # how an answer's tool block begins
TASK_TOKENS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
               "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>"}
ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")

_EFFORT_ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
_EFFORT_BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n")
# effort -> the text prepended at message 0 in thinking mode, per release's encoder (None: the encoder's default)
EFFORT_PROFILES: dict[str, dict[str | None, str]] = {
    "preview": {None: "", "high": "", "max": _EFFORT_ABSOLUTE_MAXIMUM},                      # V4-Flash, -Pro
    "0731": {None: "", "low": "", "high": _EFFORT_ABSOLUTE_MAXIMUM, "max": _EFFORT_BEYOND_MAXIMUM},  # Flash-0731
}
DEFAULT_PROFILE = "0731"
ENCODER_FILE = "encoding/encoding_dsv4.py"     # where a checkpoint ships its encoder


def profile_of_encoder(source: str) -> str | None:
    """Which release's encoder a checkpoint's encoding_dsv4.py is, from its text (never run): 0731's defines a table
    of effort prompts, the preview's one maximum-effort text. None: neither."""
    if "REASONING_EFFORT_PROMPTS" in source:
        return "0731"
    return "preview" if "REASONING_EFFORT_MAX" in source else None

TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{tool_schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


class ChatError(V4EngineError, ValueError):
    """Messages the encoder cannot render; the message names the message and field at fault."""


def to_json(value: Any) -> str:
    """JSON as the encoder writes it: `", "` and `": "` separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------- what a message holds
def _text(content: Any, where: str) -> str:
    """A message's content as one string: None is empty, a list of text parts is joined by blank lines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatError(f"{where}.content[{i}]: only text parts are supported (got "
                                f"{_kind(part)})")
            parts.append(part["text"])
        return "\n\n".join(parts)
    raise ChatError(f"{where}.content must be a string or a list of text parts (got {_kind(content)})")


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a part of type {str(value.get('type'))[:40]!r}"
    return type(value).__name__


def _arguments(call: Mapping, where: str) -> dict:
    """A tool call's arguments as a dict: a JSON object string (the OpenAI form) or a dict; empty for none. Text
    that is not a JSON object is kept as the reference keeps it, under the key "arguments"."""
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ChatError(f"{where}.function must be an object with a string name")
    raw = function.get("arguments")
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    if not isinstance(raw, str):
        raise ChatError(f"{where}.function.arguments must be a JSON string or an object (got {type(raw).__name__})")
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {"arguments": raw}
    return parsed if isinstance(parsed, dict) else {"arguments": raw}


def _tool_calls(calls: Any, where: str) -> str:
    """An assistant turn's calls in DSML, after a blank line: string values raw, others as JSON."""
    invokes = []
    for i, call in enumerate(calls):
        params = [f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
                  f'{value if isinstance(value, str) else to_json(value)}</{DSML}parameter>'
                  for key, value in _arguments(call, f"{where}.tool_calls[{i}]").items()]
        invokes.append(f'<{DSML}invoke name="{call["function"]["name"]}">\n' + "\n".join(params)
                       + f"\n</{DSML}invoke>")
    return "\n\n" + TOOL_CALLS_BLOCK + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


def _declarations(message: Mapping, where: str) -> str:
    """The tools and response-format sections a system or developer message carries."""
    out = ""
    tools = message.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
                                                  for t in tools):
            raise ChatError(f"{where}.tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}}")
        schemas = "\n".join(to_json(t["function"]) for t in tools)
        out += "\n\n" + TOOLS_TEMPLATE.replace("{tool_schemas}", schemas)
    if message.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT + to_json(message["response_format"])
    return out


def _reasoning(message: Mapping) -> str:
    """An assistant turn's reasoning: `reasoning_content` (DeepSeek's key) or `reasoning` (vLLM's)."""
    value = message.get("reasoning_content")
    if value is None:
        value = message.get("reasoning")
    return value if isinstance(value, str) else ""


# --------------------------------------------------------------------------- the encoder's steps
def _merge_tool_turns(messages: list[dict]) -> list[dict]:
    """Step 1: tool results become blocks of a user turn; consecutive user/tool turns fuse into one."""
    merged: list[dict] = []
    for message in messages:
        role = message.get("role")
        last = merged[-1] if merged else None
        fusable = last is not None and last.get("role") == "user" and "content_blocks" in last
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": message.get("tool_call_id") or "",
                     "content": message.get("content", "")}
            if fusable:
                last["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": message.get("content", "")}
            if fusable and last.get("task") is None:
                last["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content": message.get("content", ""), "content_blocks": [block],
                               **{k: message[k] for k in ("task", "wo_eos", "mask") if k in message}})
        else:
            merged.append(message)
    return merged


def _sort_tool_results(messages: list[dict]) -> None:
    """Step 2: each user turn's tool results in the order of the previous assistant's calls (other blocks stay)."""
    order: dict[str, int] = {}
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            order = {}
            for i, call in enumerate(message["tool_calls"]):
                call_id = call.get("id") or call["function"].get("id")
                if isinstance(call_id, str) and call_id:
                    order[call_id] = i
        blocks = message.get("content_blocks") if message.get("role") == "user" else None
        if blocks and order:
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                message["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b for b in blocks]


def _last_user(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def _drop_reasoning(messages: list[dict]) -> list[dict]:
    """Step 3: before the last user turn, assistants lose their reasoning and developer turns are dropped."""
    last_user = _last_user(messages)
    kept = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in ("user", "system", "tool", "latest_reminder", "direct_search_results") or i >= last_user:
            kept.append(message)
        elif role == "assistant":
            kept.append({k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")})
    return kept


def _user_body(message: Mapping, where: str) -> str:
    blocks = message.get("content_blocks")
    if not blocks:
        return _text(message.get("content"), where)
    parts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append(_text(block.get("text"), where))
        elif kind == "tool_result":
            content = block.get("content", "")
            if isinstance(content, list):
                content = "\n\n".join(p.get("text", "") if isinstance(p, Mapping) and p.get("type") == "text"
                                      else f"[Unsupported {p.get('type') if isinstance(p, Mapping) else None}]"
                                      for p in content)
            parts.append(f"<tool_result>{_text(content, where)}</tool_result>")
        else:
            parts.append(f"[Unsupported {kind}]")
    return "\n\n".join(parts)


def _render(i: int, messages: list[dict], thinking: bool, drop_thinking: bool, prefix: str) -> str:
    """Step 4: message i, and after it what opens the assistant's turn when one follows."""
    message, where = messages[i], f"messages[{i}]"
    role = message.get("role")
    last_user = _last_user(messages)
    out = prefix if i == 0 and thinking else ""
    if role == "system":
        out += _text(message.get("content"), where) + _declarations(message, where)
    elif role == "developer":
        content = _text(message.get("content"), where)
        if not content:
            raise ChatError(f"{where}: a developer message needs content")
        out += USER + content + _declarations(message, where)
    elif role == "user":
        out += USER + _user_body(message, where)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + _text(message.get("content"), where)
    elif role == "assistant":
        after_task = i > 0 and messages[i - 1].get("task") is not None
        if thinking and not after_task and (not drop_thinking or i > last_user):
            out += _reasoning(message) + END_THINK
        out += _text(message.get("content"), where)
        if message.get("tool_calls"):
            out += _tool_calls(message["tool_calls"], where)
        if not message.get("wo_eos"):
            out += EOS
    else:
        raise ChatError(f"{where}.role must be one of {', '.join(ROLES)} (got {str(role)[:40]!r})")

    following = messages[i + 1].get("role") if i + 1 < len(messages) else None
    if following is not None and following not in ("assistant", "latest_reminder"):
        return out
    task = message.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ChatError(f"{where}.task must be one of {', '.join(TASK_TOKENS)} (got {str(task)[:40]!r})")
        if task == "action":
            return out + ASSISTANT + (THINK if thinking else END_THINK) + TASK_TOKENS[task]
        return out + TASK_TOKENS[task]
    if role in ("user", "developer"):
        opens_thinking = thinking and (not drop_thinking or i >= last_user)
        out += ASSISTANT + (THINK if opens_thinking else END_THINK)
    return out


def _check_message(message: Any, where: str) -> None:
    """The fields the encoder reads have the types it reads them as (content is checked where it is rendered)."""
    if not isinstance(message, Mapping):
        raise ChatError(f"{where} must be an object (got {type(message).__name__})")
    if message.get("role") not in ROLES:
        raise ChatError(f"{where}.role must be one of {', '.join(ROLES)} (got {str(message.get('role'))[:40]!r})")
    for name in ("tool_call_id", "reasoning_content", "reasoning", "task"):
        if message.get(name) is not None and not isinstance(message[name], str):
            raise ChatError(f"{where}.{name} must be a string (got {type(message[name]).__name__})")
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ChatError(f"{where}.tool_calls must be a list (got {type(calls).__name__})")
        for j, call in enumerate(calls):
            if not isinstance(call, Mapping):
                raise ChatError(f"{where}.tool_calls[{j}] must be an object")
            _arguments(call, f"{where}.tool_calls[{j}]")


def check_effort(effort: str | None, profile: str = DEFAULT_PROFILE) -> str:
    """The effort prefix of `profile`'s encoder; ChatError naming the choices for one it does not know."""
    if profile not in EFFORT_PROFILES:
        raise ChatError(f"chat profile must be one of {', '.join(EFFORT_PROFILES)} (got {str(profile)[:40]!r})")
    table = EFFORT_PROFILES[profile]
    if effort not in table:
        names = ", ".join(e for e in table if e is not None)
        raise ChatError(f"reasoning_effort must be one of {names} for the {profile} encoding (got "
                        f"{str(effort)[:40]!r})")
    return table[effort]


def declare_tools(messages: Sequence[Mapping[str, Any]], tools: list | None) -> list:
    """The messages with a request's tools declared on message 0: its system message, or a new empty one before
    it (as vLLM and TensorRT-LLM insert it)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatError("messages must be a non-empty list of message objects")
    messages = list(messages)
    if not tools:
        return messages
    if messages and isinstance(messages[0], Mapping) and messages[0].get("role") == "system":
        return [{**messages[0], "tools": tools}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": tools}, *messages]


def encode_chat_document(text: str, profile: str = DEFAULT_PROFILE) -> str:
    """The prompt of a chat sent as one JSON text (Triton's `messages` input): a list of messages, or an object
    {"messages": [...], "tools": [...], "thinking": bool, "reasoning_effort": the encoder's name}. Equal
    settings give the prompt v4serve and v4generate --messages give."""
    try:
        document = json.loads(text)
    except ValueError as e:
        raise ChatError(f"messages is not JSON ({e})") from None
    if isinstance(document, list):
        document = {"messages": document}
    if not isinstance(document, dict):
        raise ChatError("messages must be a JSON list of messages or an object holding one")
    unknown = set(document) - {"messages", "tools", "thinking", "reasoning_effort"}
    if unknown:
        raise ChatError(f"messages: unknown field {sorted(unknown)[0][:40]!r} (known: messages, tools, thinking, "
                        "reasoning_effort)")
    thinking = document.get("thinking", False)
    if not isinstance(thinking, bool):
        raise ChatError("messages: thinking must be true or false")
    return encode_messages(declare_tools(document.get("messages"), document.get("tools")), thinking=thinking,
                           reasoning_effort=document.get("reasoning_effort"), profile=profile)


def encode_messages(messages: Sequence[Mapping[str, Any]], *, thinking: bool, reasoning_effort: str | None = None,
                    profile: str = DEFAULT_PROFILE, drop_thinking: bool = True, add_bos: bool = True) -> str:
    """The prompt string of `messages` (OpenAI-style dicts: role, content, tools, tool_calls, tool_call_id,
    reasoning_content or reasoning, and V4's own wo_eos and task), in thinking or chat (non-thinking) mode.
    The last message is usually a user turn: the string then ends with the generation prompt."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatError("messages must be a non-empty list of message objects")
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]")
    prefix = check_effort(reasoning_effort, profile)
    merged = _merge_tool_turns([copy.deepcopy(dict(m)) for m in messages])
    _sort_tool_results(merged)
    drop_thinking = drop_thinking and not any(m.get("tools") for m in merged)   # tool use keeps all reasoning
    if thinking and drop_thinking:
        merged = _drop_reasoning(merged)
    return (BOS if add_bos else "") + "".join(_render(i, merged, thinking, drop_thinking, prefix)
                                              for i in range(len(merged)))


__all__ = ["ASSISTANT", "BOS", "DEFAULT_PROFILE", "DSML", "ENCODER_FILE", "EFFORT_PROFILES", "END_THINK", "EOS", "THINK",
           "TOOL_CALLS_START", "USER", "ChatError", "check_effort", "declare_tools", "encode_chat_document",
           "encode_messages", "profile_of_encoder", "to_json"]
