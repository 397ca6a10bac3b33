"""The `v4generate` command line: generate from an engine directory with speculative decoding.

    v4generate ENGINE_DIR --prompt TEXT | --prompt-ids 1,2,3 | --messages FILE.json [--thinking]
               [--reasoning-effort E] [--show-prompt] [--max-new-tokens N] [--temperature T]
               [--top-p P] [--top-k K] [--seed S] [--drafter NAME] [--mtp K]
               [--confidence-scheduling auto|on|off] [--devices 0,1] [--stream] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from v4engine.chat.encoding import DEFAULT_PROFILE, EFFORT_PROFILES, ChatError, declare_tools, encode_messages
from v4engine.contract.errors import V4EngineError
from v4engine.contract.stages import gpu_list
from v4engine.contract.untrusted import first_line

from .detokenize import IncrementalDetokenizer
from .drafters import DRAFTERS
from .generator import Generator
from .sampling import DRAFT_SAMPLE_METHODS, SamplingParams


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="v4generate", description="Generate from a v4engine engine directory, drafting "
                                "with the engine's drafter (or another) and verifying with the target (lossless).")
    p.add_argument("engine_dir", type=Path, help="engine directory built by v4build")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the engine's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--messages", type=Path, help="a chat: a JSON file holding a list of messages (OpenAI's form: "
                     "role, content, tool_calls, ...), or an object with \"messages\" and \"tools\"; encoded with "
                     "DeepSeek-V4's chat encoding, the answer parsed into reasoning, content and tool calls")
    p.add_argument("--thinking", action="store_true", help="with --messages: thinking mode (the answer reasons "
                   "first, inside <think>...</think>); default chat mode")
    p.add_argument("--reasoning-effort", choices=["low", "high", "max"], default=None, help="with --messages "
                   "--thinking: the release's reasoning effort (0731: low, high, max; preview: high, max)")
    p.add_argument("--chat-profile", choices=list(EFFORT_PROFILES), default=None, help="with --messages: the "
                   "release whose effort texts the encoding uses: 0731 (V4-Flash-0731) or preview; default: the one "
                   f"engine.json names (from the checkpoint's encoder), else {DEFAULT_PROFILE} (and {DEFAULT_PROFILE} "
                   "for --show-prompt, which opens no engine)")
    p.add_argument("--show-prompt", action="store_true", help="with --messages: print the encoded prompt string and "
                   "exit (opens no engine)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--drafter", choices=list(DRAFTERS), default=None, help="drafting method: the engine's own draft "
                   "graph's by default (engine.json's drafter: mtp, or dspark for the current releases); prompt_lookup "
                   "drafts from n-grams of the request's own context, on any engine")
    p.add_argument("--mtp", type=int, default=None, help="draft tokens per step, 0 (no drafting) to what the drafter "
                   "makes on this engine (its own draft graph: the k it was built with); default: the engine's k "
                   "(prompt_lookup on an engine built --mtp 0: 3)")
    p.add_argument("--draft-sample-method", choices=list(DRAFT_SAMPLE_METHODS), default=None,
                   help="when sampling (--temperature > 0), how a draft graph (MTP, DSpark) draws its drafts: "
                   "probabilistic, from its own distribution at the request's settings (default), or greedy, its "
                   "argmax; either way the output follows the target's distribution exactly")
    p.add_argument("--confidence-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="verify only the drafts whose predicted survival pays for their verify cost, and skip draft "
                   "cycles that do not pay (needs a drafter with a confidence head: DSpark); costs are profiled on "
                   "this machine the first time an engine is opened with these options (a few seconds) and recorded; auto "
                   "(default): on for DSpark, off otherwise. The tokens are the same either way")
    p.add_argument("--devices", default=None, help="GPU of each pipeline stage, comma-separated, e.g. 0,1 for an engine "
                   "built with --pipeline-stages 2 (one per stage; the draft runs on the last stage's); default: every "
                   "stage where the backend runs by default (the CPU for ONNX Runtime)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    p.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, metrics")
    return p


def main(argv: list[str] | None = None) -> int:
    """Every failure is one line on stderr, never a traceback; the exit status says which kind."""
    args = parser().parse_args(argv)
    try:
        return run(args)
    except V4EngineError as e:
        print(f"v4generate: error: {e}", file=sys.stderr)
        return 1
    except MemoryError as e:      # an allocation beyond what the process may take (`ulimit -v`, a cgroup)
        print(f"v4generate: error: out of memory ({type(e).__name__}: {first_line(e)}); give the process more "
              "memory, or build the engine for a smaller --max-batch or --max-seq-len", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("v4generate: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT                      # as a shell reports a command that Ctrl-C ended
    except BrokenPipeError:
        # The reader closed stdout (`v4generate ... | head`): nothing is left to say to anyone. Python would flush
        # stdout again at exit and report that failure too, so stdout becomes devnull (the Python docs' advice,
        # "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def read_chat(path: Path) -> tuple[list, list | None]:
    """(messages, tools) of a --messages file: a list of messages, or {"messages": [...], "tools": [...]}."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise V4EngineError(f"--messages {path}: not a readable JSON file ({first_line(e)})") from None
    if isinstance(data, dict):
        return data.get("messages"), data.get("tools")
    return data, None


def run(args: argparse.Namespace) -> int:
    if args.messages is None and (args.thinking or args.reasoning_effort or args.show_prompt):
        raise V4EngineError("--thinking, --reasoning-effort and --show-prompt go with --messages")
    if args.messages is not None:
        messages, tools = read_chat(args.messages)
        if args.show_prompt:
            try:
                print(encode_messages(declare_tools(messages, tools), thinking=args.thinking,
                                      reasoning_effort=args.reasoning_effort,
                                      profile=args.chat_profile or DEFAULT_PROFILE), end="")
            except ChatError as e:
                raise V4EngineError(f"--messages {args.messages}: {e}") from None
            return 0
    prompt = args.prompt
    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise V4EngineError(f"--prompt-ids must be comma-separated integers (got {args.prompt_ids!r})") from None
    devices = gpu_list(args.devices, "--devices") if args.devices is not None else None
    scheduling = {"auto": None, "on": True, "off": False}[args.confidence_scheduling]
    generator = Generator.from_engine_dir(args.engine_dir, mtp=args.mtp, drafter=args.drafter, devices=devices,
                                          own_process=True, confidence_scheduling=scheduling)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                              draft_sample_method=args.draft_sample_method)
    if args.messages is not None:
        chat = generator.chat(messages, sampling, tools=tools, thinking=args.thinking,
                              reasoning_effort=args.reasoning_effort, profile=args.chat_profile)
        message = {"reasoning_content": chat.message.reasoning, "content": chat.message.content,
                   "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in chat.message.tool_calls]}
        if args.json:
            print(json.dumps({"prompt_token_ids": chat.result.prompt_token_ids, "token_ids": chat.result.token_ids,
                              "message": message, "finish_reason": chat.result.finish_reason}, ensure_ascii=False))
        else:
            if chat.message.reasoning:
                print(f"[reasoning]\n{chat.message.reasoning}\n[answer]")
            print(chat.message.content or "")
            for call in message["tool_calls"]:
                print(f"[tool call] {call['function']['name']}({call['function']['arguments']})")
            print()
            print(generator.totals.table())
    elif args.stream and not args.json:       # text pieces never split a character nor show a stop string
        detok = IncrementalDetokenizer(generator.tokenizer, sampling.stop) if generator.tokenizer else None
        for chunk in generator.stream(prompt, sampling):
            print(detok.add(chunk) if detok else " ".join(map(str, chunk)) + " ", end="", flush=True)
        print(detok.finish() if detok else "")
        print(generator.totals.table())
    else:
        [result] = generator.generate([prompt], sampling)
        if args.json:
            metrics = {k: result.metrics[k] for k in ("drafted", "accepted", "acceptance_rate",
                                                       "mean_acceptance_length", "per_position_acceptance",
                                                       "verify_steps", "mean_confidence", "time_to_first_token",
                                                       "tokens_per_second")}
            print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason, "metrics": metrics}))
        else:
            print(result.text if result.text is not None else " ".join(map(str, result.token_ids)))
            print()
            print(generator.totals.table())
    sys.stdout.flush()                      # a closed stdout fails here, inside main's handlers, not at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
