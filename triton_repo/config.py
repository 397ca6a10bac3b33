"""The repository's tensor contract and the config.pbtxt of each model, generated from it.

Four models, one flow (docs/architecture.md §1, docs/backends.md §7):

    text_input | input_ids, stop, max_tokens ──► preprocessing ──► prompt_ids, stop_words
    prompt_ids, stop_words, max_tokens, sampling ──► v4_generate (decoupled) ──► ids of each step, metrics
    ids of each response, stop strings ──► postprocessing ──► text_output
    ensemble: the three steps behind the client-facing names

The ensemble is wired by name from the lists below: a step input takes the ensemble input or output of the same
name if there is one, else the internal tensor "_<name>" that an earlier step produces; a step output feeds the
ensemble output of its name, else "_<name>". The GPU variant differs in one place: v4_generate's instances are
KIND_GPU and open the engine with ONNX Runtime's CUDA provider (a TensorRT engine loads as the runtime decides).
An engine split into pipeline stages spans several GPUs per instance (`gpus`): its instances are KIND_MODEL (Triton
places nothing; the model puts stage i on gpus[i]), with the list in the `gpus` parameter.
Every model has max_batch_size 0: one prompt per request, and v4_generate's scheduler, not Triton, batches the
requests in flight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str                      # Triton's data type without its TYPE_ prefix
    dims: tuple[int, ...] = (1,)
    optional: bool = False


@dataclass(frozen=True)
class Options:
    """What render() puts into the configs."""

    engine_dir: str
    max_seq_len: int
    max_batch: int
    max_queue_size: int
    instance_count: int = 1
    gpu: bool = False
    gpus: tuple[int, ...] = ()      # an instance spanning these GPUs, one per pipeline stage (KIND_MODEL)
    drafter: str | None = None      # the drafting method (None: the engine's own)
    mtp: int | None = None          # draft tokens per step (None: the drafter's default)
    providers: tuple[str, ...] = ()  # execution providers for a backend whose sessions take them, on GPUs
    confidence_scheduling: bool | None = None    # None: the Generator's default (on for DSpark)
    report_prefix_hits: bool = False   # per-request metrics name prefix_hit_tokens (else only the Prometheus total)
    chat_profile: str | None = None    # the engine's chat encoding release (engine.json; None: the default)


# The settings a client may send, named as tensorrtllm_backend names them where it has the setting.
SAMPLING = (
    Tensor("temperature", "FP32", optional=True),       # 0 (the default) is greedy
    Tensor("top_p", "FP32", optional=True),
    Tensor("top_k", "INT32", optional=True),
    Tensor("seed", "INT64", optional=True),
    Tensor("presence_penalty", "FP32", optional=True),  # OpenAI's presence and frequency penalties, from -2 to 2
    Tensor("frequency_penalty", "FP32", optional=True),
    Tensor("repetition_penalty", "FP32", optional=True),   # tensorrtllm_backend's name; 1 (the default) is none
    Tensor("num_draft_tokens", "INT32", optional=True),  # drafts per step, 0..the repository's k (default k)
    Tensor("draft_sample_method", "STRING", optional=True),    # "probabilistic" (default) or "greedy" drafts
    Tensor("cache_salt", "STRING", optional=True),      # keys the prefix cache: tenants of other salts share nothing
    Tensor("ignore_eos", "BOOL", optional=True),
    Tensor("stream", "BOOL", optional=True),             # one response per step instead of one at the end
    Tensor("exclude_input_in_output", "BOOL", optional=True),   # default true: generated text only
)
# Required, yet the ensemble lists it as optional: Triton's ensemble runs no step whose required input is missing
# and answers such a request with nothing at all (HTTP generate: "expects model to produce exactly 1 response").
# Preprocessing requires it: Triton refuses a preprocessing request with no input at all, naming max_tokens, and
# the model refuses one that has others but not this one (models/preprocessing.py).
MAX_TOKENS = Tensor("max_tokens", "INT32")
PROMPT_IDS = Tensor("prompt_ids", "INT32", (-1,))
STOP_WORDS = Tensor("stop_words", "STRING", (-1,))
# What a client gets: the ids and text of each response; finish_reason ("stop", "length") and the request's
# acceptance metrics (JSON) on the last response, "" before it.
TEXT_OUTPUT, OUTPUT_IDS = Tensor("text_output", "STRING"), Tensor("output_ids", "INT32", (-1,))
FINISH_REASON, METRICS = Tensor("finish_reason", "STRING"), Tensor("metrics", "STRING")
# What v4_generate tells postprocessing about each response (models/postprocessing.py)
ECHO_IDS = Tensor("echo_ids", "INT32", (-1,))              # prompt ids shown before the text (first response)
GENERATED_IDS = Tensor("generated_ids", "INT32", (-1,))    # every id generated so far
NEW_TOKENS = Tensor("new_tokens", "INT32")                 # how many of them this response adds
CANCEL_KEY = Tensor("cancel_key", "STRING")                # where postprocessing relays a cancellation
STOP_STRINGS = Tensor("stop_strings", "STRING", (-1,))     # stop_words again: Triton refuses a step that mixes
                                                           # tensors of a decoupled step with earlier ones

TEXT_INPUT = Tensor("text_input", "STRING", optional=True)
INPUT_IDS = Tensor("input_ids", "INT32", (-1,), optional=True)
# a chat as JSON: messages, or {"messages", "tools", "thinking", "reasoning_effort"} (chat/encoding.py
# encode_chat_document), encoded with DeepSeek-V4's chat encoding
MESSAGES = Tensor("messages", "STRING", optional=True)
STOP = Tensor("stop", "STRING", (-1,), optional=True)
ENSEMBLE_INPUTS = (TEXT_INPUT, INPUT_IDS, MESSAGES, replace(MAX_TOKENS, optional=True), STOP, *SAMPLING)
ENSEMBLE_OUTPUTS = (TEXT_OUTPUT, OUTPUT_IDS, FINISH_REASON, METRICS)


@dataclass(frozen=True)
class Model:
    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    doc: str
    decoupled: bool = False


PREPROCESSING = Model(
    "preprocessing", inputs=(TEXT_INPUT, INPUT_IDS, MESSAGES, MAX_TOKENS, STOP), outputs=(PROMPT_IDS, STOP_WORDS),
    doc="text, token ids or a chat -> prompt ids; stop strings; max_tokens checked against the engine")
V4_GENERATE = Model(
    "v4_generate", inputs=(PROMPT_IDS, MAX_TOKENS, replace(STOP_WORDS, optional=True), *SAMPLING),
    outputs=(OUTPUT_IDS, ECHO_IDS, GENERATED_IDS, NEW_TOKENS, FINISH_REASON, METRICS, CANCEL_KEY, STOP_STRINGS),
    doc="MTP speculative decoding; one v4engine.runtime scheduler batches every request in flight", decoupled=True)
POSTPROCESSING = Model(
    "postprocessing", inputs=(ECHO_IDS, GENERATED_IDS, NEW_TOKENS, FINISH_REASON, CANCEL_KEY, STOP_STRINGS),
    outputs=(TEXT_OUTPUT,),
    doc="incremental detokenization of each response; relays a client's cancellation to v4_generate")
STEPS = (PREPROCESSING, V4_GENERATE, POSTPROCESSING)


def ensemble_map(step: Model) -> tuple[dict[str, str], dict[str, str]]:
    """(input_map, output_map) of one ensemble step: step tensor name -> ensemble tensor name."""
    public = {t.name for t in ENSEMBLE_INPUTS + ENSEMBLE_OUTPUTS}
    inputs = {t.name: t.name if t.name in public else f"_{t.name}" for t in step.inputs}
    outputs = {t.name: t.name if t.name in {o.name for o in ENSEMBLE_OUTPUTS} else f"_{t.name}"
               for t in step.outputs}
    return inputs, outputs


# ---------------------------------------------------------------------- config.pbtxt
def _inputs(items: tuple[Tensor, ...]) -> list[mc.ModelInput]:
    return [mc.ModelInput(name=t.name, data_type=mc.DataType.Value(f"TYPE_{t.dtype}"), dims=t.dims,
                          optional=t.optional) for t in items]


def _outputs(items: tuple[Tensor, ...]) -> list[mc.ModelOutput]:
    return [mc.ModelOutput(name=t.name, data_type=mc.DataType.Value(f"TYPE_{t.dtype}"), dims=t.dims) for t in items]


def python_model(model: Model, options: Options) -> mc.ModelConfig:
    """The config of one Python-backend step."""
    generate = model is V4_GENERATE
    config = mc.ModelConfig(name=model.name, backend="python", max_batch_size=0,
                            input=_inputs(model.inputs), output=_outputs(model.outputs))
    config.model_transaction_policy.decoupled = model.decoupled
    kind = mc.ModelInstanceGroup.KIND_CPU
    if generate and options.gpus:
        kind = mc.ModelInstanceGroup.KIND_MODEL
    elif generate and options.gpu:
        kind = mc.ModelInstanceGroup.KIND_GPU
    config.instance_group.add(count=options.instance_count if generate else 1, kind=kind)
    # No step has a dynamic batcher. With max_batch_size 0 it batches nothing, and in 2.51 it does harm: it drops
    # cancelled requests before postprocessing can relay them (models/relay.py), and a request that arrives while
    # the instance is busy waits for the batcher's 500 ms idle timeout (dynamic_batch_scheduler.cc), so
    # concurrent streams started late (benchmarks/RESULTS.md). Requests go straight to the instance; v4_generate takes
    # each at once (its execute is async) and its serving loop refuses what exceeds max_batch + max_queue_size.
    values: dict[str, object] = {"engine_dir": options.engine_dir}
    if model is PREPROCESSING:
        values["max_seq_len"] = options.max_seq_len
        if options.chat_profile is not None:
            values["chat_profile"] = options.chat_profile
    if generate:
        values.update(max_batch=options.max_batch, max_queue_size=options.max_queue_size)
        values.update({name: value for name, value in (("drafter", options.drafter), ("mtp", options.mtp))
                       if value is not None})
        if options.confidence_scheduling is not None:
            values["confidence_scheduling"] = "on" if options.confidence_scheduling else "off"
        if options.report_prefix_hits:
            values["report_prefix_hits"] = "on"
        if options.providers:
            values["providers"] = ",".join(options.providers)
        if options.gpus:
            values["gpus"] = ",".join(map(str, options.gpus))
    for key, value in values.items():
        config.parameters[key].string_value = str(value)
    return config


def ensemble_model() -> mc.ModelConfig:
    """The client-facing model: preprocessing -> v4_generate -> postprocessing."""
    config = mc.ModelConfig(name="ensemble", platform="ensemble", max_batch_size=0,
                            input=_inputs(ENSEMBLE_INPUTS), output=_outputs(ENSEMBLE_OUTPUTS))
    for step in STEPS:
        inputs, outputs = ensemble_map(step)
        config.ensemble_scheduling.step.add(model_name=step.name, model_version=-1, input_map=inputs,
                                            output_map=outputs)
    return config


def model_configs(options: Options) -> dict[str, str]:
    """config.pbtxt text per model name, written by protobuf's own text format (the models' docs as comments)."""
    configs = {step.name: (step.doc, python_model(step, options)) for step in STEPS}
    configs["ensemble"] = ("the client-facing model: preprocessing -> v4_generate -> postprocessing", ensemble_model())
    return {name: f"# {doc}\n" + text_format.MessageToString(config) for name, (doc, config) in configs.items()}
