"""preprocessing: the request as the client sent it -> prompt ids and stop strings for v4_generate.

The prompt is `text_input` (UTF-8, tokenized with the engine's tokenizer.json by the runtime's own
`v4engine.runtime.generator.encode_text`), `input_ids` (token ids as given; v4_generate checks them against the
vocabulary) or `messages` (a chat as JSON, through DeepSeek-V4's chat encoding: chat/encoding.py
encode_chat_document, the prompt v4serve gives the same chat). `stop` strings are checked to be UTF-8 and empty ones dropped. What cannot be served is refused here
with one line naming the input: no prompt or two, text that is not UTF-8 or longer than any servable prompt (before
it is tokenized: megabytes would hold this one instance for seconds), an input holding more values than one,
`max_tokens` absent (the ensemble lists it as optional so that this step runs to say so: config.MAX_TOKENS), <= 0
or beyond the engine's max_seq_len. Anything else that goes wrong is one line too (io.failure), never a traceback.
"""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from v4engine.chat.encoding import DEFAULT_PROFILE, ChatError, encode_chat_document
from v4engine.runtime.generator import encode_text, load_tokenizer, longest_prompt_bytes
from v4engine.runtime.sampling import RequestError
from v4engine.triton_repo.server import die_with_server

from . import io


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        die_with_server()
        params = io.parameters(args)
        self.tokenizer = load_tokenizer(params["engine_dir"])
        self.max_seq_len = int(params["max_seq_len"])
        self.chat_profile = params.get("chat_profile", DEFAULT_PROFILE)
        self.max_text_bytes = longest_prompt_bytes(self.tokenizer, self.max_seq_len - 1) \
            if self.tokenizer is not None else None

    def execute(self, requests: list) -> list:
        return io.answer_each("preprocessing", requests, self.answer)

    def answer(self, request) -> "pb_utils.InferenceResponse":
        prompt, stop = self.prepare(request)
        return pb_utils.InferenceResponse([io.tensor("prompt_ids", prompt, np.int32),
                                           io.tensor("stop_words", stop, np.object_)])

    def prepare(self, request) -> tuple[list[int], list[bytes]]:
        max_tokens = io.scalar(request, "max_tokens", required=True)
        if max_tokens <= 0 or max_tokens > self.max_seq_len:
            raise RequestError(f"max_tokens must be from 1 to the engine's max_seq_len {self.max_seq_len} "
                               f"(got {max_tokens})")
        text, ids, chat = io.strings(request, "text_input"), io.array(request, "input_ids"), \
            io.strings(request, "messages")
        if [bool(text), ids is not None, bool(chat)].count(True) != 1:
            raise RequestError("give the prompt as text_input, input_ids or messages (exactly one of them)")
        for name, given in (("text_input", text), ("messages", chat)):
            if len(given) > 1:
                raise RequestError(f"{name} must hold one prompt (got {len(given)})")
        if chat:
            if self.max_text_bytes is not None and len(chat[0].encode()) > self.max_text_bytes:
                raise RequestError(f"messages has {len(chat[0].encode())} bytes, more than a prompt this engine "
                                   f"serves can hold ({self.max_text_bytes})")
            try:
                text = [encode_chat_document(chat[0], self.chat_profile)]
            except ChatError as e:
                raise RequestError(str(e)) from None
        prompt = encode_text(self.tokenizer, text[0], self.max_text_bytes) if text else ids.tolist()
        stop = [s.encode() for s in io.strings(request, "stop") if s]
        return prompt, stop
