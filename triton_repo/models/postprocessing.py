"""postprocessing: the ids of each v4_generate response -> its text_output.

Each response of a stream reaches this step as a request of its own, so the step keeps no state: a request
carries every id generated so far and how many of them are new, and its text is the piece those new ids release
(v4engine.runtime.detokenize.text_piece: never half of a multi-byte character, spaces kept, the text cut before
the first stop string, held-back text released by the last response). The pieces of a stream join to exactly
the text v4engine.runtime gives for the same request. With `exclude_input_in_output` false, the first response's
text starts with the prompt's (`echo_ids`).

A cancelled request here means the client cancelled the ensemble request: its cancel_key is relayed to the
v4_generate instance that is still generating for it (models/relay.py), without ever waiting. A client may also
call this model directly, with any tensors: what does not fit is one line naming the input (io.failure).
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from v4engine.runtime.detokenize import text_piece
from v4engine.runtime.generator import load_tokenizer
from v4engine.runtime.sampling import RequestError
from v4engine.triton_repo.server import die_with_server

from . import io
from .relay import relay_cancel


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        die_with_server()
        self.tokenizer = load_tokenizer(io.parameters(args)["engine_dir"])
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def execute(self, requests: list) -> list:
        return io.answer_each("postprocessing", requests, self.answer)

    def answer(self, request) -> "pb_utils.InferenceResponse":
        if request.is_cancelled():
            key = io.array(request, "cancel_key")
            if key is not None and key.size == 1:
                relay_cancel(key[0])
            # answered, not failed: in Triton 2.51 an error here leaves the cancelled ensemble request in
            # flight for good, and the server's shutdown then waits for it until --exit-timeout-secs
            return pb_utils.InferenceResponse([io.text("text_output", "")])
        echo, generated = io.array(request, "echo_ids").tolist(), io.array(request, "generated_ids").tolist()
        for name, ids in (("echo_ids", echo), ("generated_ids", generated)):
            bad = next((t for t in ids if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise RequestError(f"{name}: {bad} is not a token id of this engine's tokenizer [0, {self.vocab})")
        new = io.scalar(request, "new_tokens", required=True)
        if not 0 <= new <= len(generated):
            raise RequestError(f"new_tokens must be from 0 to the {len(generated)} generated_ids (got {new})")
        piece = text_piece(self.tokenizer, generated, new, io.strings(request, "stop_strings"),
                           final=io.scalar(request, "finish_reason") != "")
        prefix = self.tokenizer.decode(echo) if echo else ""
        return pb_utils.InferenceResponse([io.text("text_output", prefix + piece)])
