"""preprocessing: the request as the client sent it -> prompt ids and stop strings for v4_generate.

The prompt is `text_input` (UTF-8, tokenized with the engine's tokenizer.json by the runtime's own
`v4engine.runtime.generator.encode_text`) or `input_ids` (token ids as given; v4_generate checks them against the
vocabulary). `stop` strings are checked to be UTF-8 and empty ones dropped. What cannot be served is refused here
with one line naming the input: no prompt or two, text that is not UTF-8 or longer than any servable prompt (before
it is tokenized: megabytes would hold this one instance for seconds), an input holding more values than one,
`max_tokens` absent (the ensemble lists it as optional so that this step runs to say so: config.MAX_TOKENS), <= 0
or beyond the engine's max_seq_len. Anything else that goes wrong is one line too (io.failure), never a traceback.
"""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

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
        text, ids = io.strings(request, "text_input"), io.array(request, "input_ids")
        if (text == []) == (ids is None):
            raise RequestError("give the prompt as text_input or as input_ids (exactly one of them)")
        if text:
            if len(text) != 1:
                raise RequestError(f"text_input must hold one prompt (got {len(text)})")
            prompt = encode_text(self.tokenizer, text[0], self.max_text_bytes)
        else:
            prompt = ids.tolist()
        stop = [s.encode() for s in io.strings(request, "stop") if s]
        return prompt, stop
