"""v4_generate: speculative decoding with the engine's MTP draft, for every request in flight at once.

Decoupled, with `async def execute`: Triton hands over each request as it arrives and does not wait for its
coroutine, so requests overlap. All of them go to one v4engine.runtime scheduler per model instance, stepped by a
background thread (runtime/serving.py): requests that arrive together share the engine's draft and verify calls.
A streaming request gets one response per step that gave it tokens (1..k+1 of them), a non-streaming one a single
response at the end; the last response carries finish_reason and the request's acceptance metrics as JSON, and
the FINAL flag is always sent, whatever happens (a decoupled request without it hangs its client).

Cancellation: `is_cancelled()` is asked before every step (a client that calls this model directly), and
postprocessing relays the cancellation of an ensemble request (models/relay.py). Either way the request leaves
the scheduler at the next step and its caches are freed.

Prometheus metrics (Triton's metrics port), labelled with the model: time to first token and inter-token latency
histograms, drafted / accepted draft tokens, verify steps and acceptances per draft position (per-position
acceptance = v4_accepted_at_position_total / v4_verify_steps_total), generated tokens, engine steps, the number of
requests waiting and running, and what the serving loop holds (requests pending, cache bytes in use) so that a
soak can see from outside that everything it sent was released.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import fields
from importlib.util import find_spec

import numpy as np
import triton_python_backend_utils as pb_utils

from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.metrics import SERIES, finished_counts
from v4engine.runtime.sampling import SamplingParams
from v4engine.runtime.scheduler import Request
from v4engine.runtime.serving import ServingLoop, Stream
from v4engine.triton_repo.server import die_with_server

from ..config import SAMPLING
from . import io
from .relay import CancelRelay

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SETTINGS = tuple(t.name for t in SAMPLING if t.name in {f.name for f in fields(SamplingParams)})   # passed on as is


class Metrics:
    """The model's Prometheus series (runtime/metrics.py SERIES, which v4serve exports too). Every MetricFamily
    stays referenced: Triton deletes a family whose Python object is collected ("Invalid metric operation as the
    corresponding 'MetricFamily' has been deleted")."""

    def __init__(self, labels: dict[str, str], positions: int):
        F = pb_utils.MetricFamily
        kinds = {"counter": F.COUNTER, "gauge": F.GAUGE, "histogram": F.HISTOGRAM}
        self.families = {key: F(name=s.name, description=s.doc, kind=kinds[s.kind]) for key, s in SERIES.items()}
        self.series: dict = {}
        for key, s in SERIES.items():
            extra = {"buckets": list(s.buckets)} if s.buckets else {}
            self.series[key] = ([self.families[key].Metric(labels={**labels, "position": str(i + 1)}, **extra)
                                 for i in range(positions)] if s.per_position
                                else self.families[key].Metric(labels=labels, **extra))

    def finished(self, request: Request) -> None:
        for key, position, value in finished_counts(request.metrics):
            series = self.series[key]
            if position is None:
                series.increment(value)
            elif position <= len(series):
                series[position - 1].increment(value)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        die_with_server()
        params = io.parameters(args)
        options: dict = {}
        if "providers" in params:                       # an ONNX Runtime engine on GPUs (rendered so only for one)
            names = params["providers"].split(",")
            if args["model_instance_kind"] == "GPU":   # the CUDA provider on this instance's device
                names = [(n, {"device_id": args["model_instance_device_id"]}) if n == "CUDAExecutionProvider"
                         else n for n in names]
            options["providers"] = names
            if not find_spec("torch"):      # the caches live on the GPU where this Python has torch; else on the
                options["device_pools"] = False                                       # host, copied every call
        devices = [int(g) for g in params["gpus"].split(",")] if "gpus" in params else None   # KIND_MODEL: stage i
        generator = Generator.from_engine_dir(params["engine_dir"], drafter=params.get("drafter"),
                                              mtp=int(params["mtp"]) if "mtp" in params else None,
                                              limits=Limits(max_batch=int(params["max_batch"])), devices=devices,
                                              backend_options=options, confidence_scheduling={
                                                  "on": True, "off": False}.get(params.get("confidence_scheduling")))
        self.metrics = Metrics({"model": args["model_name"], "version": args["model_version"]},
                               positions=generator.scheduler.mtp)
        self.exported: dict[str, int] = {}             # engine steps and each gauge, as last exported
        self.serving = ServingLoop(generator, max_queue_size=int(params["max_queue_size"]), on_update=self.export)
        self.relay = CancelRelay()
        self.report_prefix_hits = params.get("report_prefix_hits") == "on"

    def export(self) -> None:
        """Whenever requests joined, left or stepped (on the scheduler's thread): engine steps and the gauges,
        each only when it changed (every update is a message to the Triton process)."""
        now = self.serving.gauges()
        for key, value in now.items():
            before = self.exported.get(key, 0)
            if value != before:
                if key == "engine_steps":
                    self.metrics.series[key].increment(value - before)
                else:
                    self.metrics.series[key].set(value)
        self.exported = now

    async def execute(self, requests: list) -> None:
        await asyncio.gather(*(self.serve(request) for request in requests))

    async def serve(self, request) -> None:
        sender = request.get_response_sender()
        final_sent, failure = False, None
        try:
            prompt, params, streaming, echo = self.read(request)
            stream = self.serving.submit(prompt, params, is_cancelled=sender.is_cancelled)
            with self.relay.listening(lambda: self.serving.cancel(stream)) as key:
                final_sent = await self.respond(sender, stream, key, prompt if echo else [], streaming)
        except Exception as e:                              # noqa: BLE001 - the client must hear of it
            failure = io.failure("v4_generate", e)
        finally:
            if not final_sent:
                sender.send(failure, flags=FINAL)          # failure None: the flag alone

    def read(self, request) -> tuple[list[int], SamplingParams, bool, bool]:
        """(prompt ids, sampling parameters, stream?, echo the prompt?) from the request's tensors."""
        prompt = io.array(request, "prompt_ids").tolist()
        settings = {name: io.scalar(request, name) for name in SETTINGS}
        params = SamplingParams(max_new_tokens=int(io.scalar(request, "max_tokens", required=True)),
                                stop=tuple(s for s in io.strings(request, "stop_words") if s),
                                **{name: value for name, value in settings.items() if value is not None})
        exclude = io.scalar(request, "exclude_input_in_output")
        return prompt, params, bool(io.scalar(request, "stream")), exclude is False

    async def respond(self, sender, stream: Stream, key: bytes, echo: list[int], streaming: bool) -> bool:
        """Send the stream's responses; True once the FINAL flag went out with the last one."""
        generated: list[int] = []
        last = None
        async for update in stream:
            generated += update.tokens
            if update.tokens:
                if last is None:
                    self.metrics.series["ttft"].observe(stream.request.metrics.time_to_first_token)
                else:
                    self.metrics.series["itl"].observe(update.time - last)
                last = update.time
            if streaming and update.tokens and not update.finished:
                sender.send(self.response(echo, generated, len(update.tokens), key, stream.request.params.stop))
                echo = []
        request = stream.request
        self.metrics.finished(request)
        if request.finish_reason == "cancelled":
            return False
        metrics = request.metrics.to_dict()
        if not self.report_prefix_hits:          # a per-response hit count tells one client another's prompts
            del metrics["prefix_hit_tokens"]
        new = len(update.tokens) if streaming else len(generated)
        sender.send(self.response(echo, generated, new, key, request.params.stop, request.finish_reason,
                                  json.dumps(metrics)), flags=FINAL)
        return True

    def response(self, echo: list[int], generated: list[int], new: int, key: bytes, stop: tuple[str, ...],
                 finish_reason: str = "", metrics: str = "") -> "pb_utils.InferenceResponse":
        return pb_utils.InferenceResponse([
            io.tensor("output_ids", echo + generated[len(generated) - new:], np.int32),
            io.tensor("echo_ids", echo, np.int32),
            io.tensor("generated_ids", generated, np.int32),
            io.tensor("new_tokens", [new], np.int32),
            io.text("finish_reason", finish_reason),
            io.text("metrics", metrics),
            io.tensor("cancel_key", [key], np.object_),
            io.tensor("stop_strings", [s.encode() for s in stop], np.object_),
        ])

    def finalize(self) -> None:
        self.relay.close()
        self.serving.close()
