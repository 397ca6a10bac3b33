"""TensorRT: the exported graphs, prepared for TensorRT's ONNX parser, then built into serialized engines.

Preparation (always; all that `--onnx-only` does):
- every attention, indexer and compressor node gets `aot=1`, so TensorRT takes the plugin's ahead-of-time PTX
  kernel (plugins/tensorrt). The nodes already carry `plugin_namespace="v4"`, which makes the parser prefer the
  plugin over the model-local function of the same name; the builder also sets the parser flag
  ENABLE_PLUGIN_OVERRIDE. The functions stay in the graph as the op's definition (and as what ONNX Runtime runs
  when the prepared graph is checked against the ONNX Runtime engine).
- every routed-experts node becomes a plugin node too (the plugin attributes, no `aot`: it runs its kernels'
  torch launcher just in time, so the process that loads the engine registers the plugins, as the runtime does);
  quantized experts reach it as their stored bytes and fp32 scales (builder/weights.py, STORED_BYTES:
  Fp8RoutedExperts, Mxfp4RoutedExperts), dequantized inside its kernels.
- precisions are all in the graph (TensorRT 11 builds strongly typed networks only): activations in the build
  dtype, hc mixes, sinks and softmaxes in fp32, FP8 weights in place with a blocked DequantizeLinear.
- optimization profiles, one per kind of call the runtime makes (`profiles`), recorded in engine.json.

Build (TensorRT importable, no `--onnx-only`): a strongly typed network parsed from each prepared graph, a timing
cache (read if it exists, written back after) and `--builder-optimization-level`; each serialized engine goes next
to its graph as `{graph}.plan`, **without its weights**: STRIP_PLAN with REFIT_IDENTICAL (a plan of the
non-refittable engine's speed whose refittable weights are left out; TensorRT 10/11 NvInfer.h), refitted by the
session from the graph's own weight files, the checkpoint's (runtime/sessions/tensorrt.py). A refittable engine
takes a single optimization profile (NvInfer.h, addOptimizationProfile), so the plan holds one covering every
call, its opt shapes the per-token call's (`merged_profile`: decode is what runs most); engine.json keeps the
calls' own profiles, which give the CUDA graphs' buckets, and records the plan's as `plan_profiles`.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from v4engine.contract.backend_options import TensorRTBuild
from v4engine.contract.backends import TIMING_CACHE, BuiltPlan, TensorRTCompiled
from v4engine.contract.calls import CAPTURED_CALLS, captured_calls
from v4engine.contract.engine import EngineManifest
from v4engine.contract.errors import V4EngineError
from v4engine.contract.profiles import Profile, merged_profile
from v4engine.plugins import AOT_OPS, DOMAIN
from v4engine.plugins.common import plugin_attrs
from v4engine.plugins.tensorrt import MIN_TENSORRT, TensorRTNotInstalled, register_plugins

from ..weights import use_stored_experts
from .profiles import engine_profiles

if TYPE_CHECKING:
    from ..build import BuildOptions



class TensorRTBuildError(V4EngineError):
    """TensorRT is missing, or refused a graph or a build."""


def mark_aot(model: onnx.ModelProto) -> int:
    """Mark every v4 node of an op with an AOT kernel (AOT_OPS) for TensorRT's AOT plugins (in place); returns how
    many."""
    marked = 0
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type in AOT_OPS:
            kept = [a for a in node.attribute if a.name != "aot"]       # idempotent
            del node.attribute[:]
            node.attribute.extend(kept + [onnx.helper.make_attribute("aot", 1)])
            marked += 1
    for function in model.functions:      # declared on the ops' definitions, as plugin_namespace is
        if function.domain == DOMAIN and function.name in AOT_OPS and "aot" not in function.attribute:
            function.attribute.append("aot")
    return marked


def preflight(options: TensorRTBuild) -> None:
    """TensorRT must be importable unless the build stops before it (--onnx-only)."""
    if not options.onnx_only:
        check_installed()


def prepare_graph(model: onnx.ModelProto, name: str, options: TensorRTBuild | None = None
                  ) -> tuple[onnx.ModelProto, int]:
    """The graph with every attention, indexer and compressor node marked for its AOT plugin kernel (mark_aot) and
    every routed-experts node a just-in-time plugin node over the experts as stored; how many plugin nodes."""
    experts = use_stored_experts(model)
    for node in experts:
        kept = [a for a in node.attribute if not a.name.startswith("plugin_")]         # idempotent
        del node.attribute[:]
        node.attribute.extend(kept + [onnx.helper.make_attribute(k, v) for k, v in plugin_attrs().items()])
    return model, mark_aot(model) + len(experts)


def check_installed() -> Any:
    """The tensorrt module, with the v4 plugins registered; TensorRTBuildError (one line) when it cannot be."""
    try:
        register_plugins()
    except TensorRTNotInstalled as e:
        raise TensorRTBuildError(f"--backend tensorrt: {e}; pass --onnx-only to prepare the graphs without "
                                 f"building engines (TensorRT {'.'.join(map(str, MIN_TENSORRT))}+ builds them)"
                                 ) from None
    import tensorrt

    return tensorrt


def build_plan(trt: Any, onnx_path: Path, plan_path: Path, graph_profiles: Sequence[Profile], optimization_level: int,
               timing_cache: Path, seed_cache: Path | None = None, fp32: bool = False) -> BuiltPlan:
    """Parse, configure and build one serialized engine without its weights (TensorRT's documented Python API; the
    module doc says why one profile: `graph_profiles` are what the plan holds).

    The timing cache is read from `timing_cache`, else from `seed_cache` (the engine being replaced), and written
    to `timing_cache`. fp32 engines build without TF32 (on by default in TensorRT), so they stay exact to fp32."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    # plugin_namespace on our nodes already makes the parser prefer the v4 plugins; the flag (10.15+) says so for
    # every node. No standard op of our graphs shares a name with a registered plugin, so nothing else changes.
    parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if not parser.parse_from_file(str(onnx_path)):
        error = parser.get_error(0)
        raise TensorRTBuildError(f"{onnx_path}: TensorRT's ONNX parser failed at node '{error.node_name()}': "
                                 f"{error.desc()} ({parser.num_errors} error(s))")
    config = builder.create_builder_config()
    config.builder_optimization_level = optimization_level
    config.set_flag(trt.BuilderFlag.STRIP_PLAN)          # the weights stay in the checkpoint's files
    config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)     # refitted with exactly those: the plan keeps full speed
    if fp32:
        config.clear_flag(trt.BuilderFlag.TF32)
    known = next((c for c in (timing_cache, seed_cache) if c is not None and c.is_file()), None)
    cache = config.create_timing_cache(known.read_bytes() if known else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    for profile in graph_profiles:
        optimization_profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile.shapes.items():
            optimization_profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(optimization_profile)
    started = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TensorRTBuildError(f"{onnx_path}: TensorRT could not build an engine (see its log above)")
    plan_path.write_bytes(bytes(serialized))
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return BuiltPlan(plan_path.name, plan_path.stat().st_size, round(time.perf_counter() - started, 1), stripped=True)


def plan_profiles(graph_profiles: dict[str, tuple[Profile, ...]]) -> dict[str, tuple[Profile, ...]]:
    """Each graph's one profile for its stripped plan: every call's shapes, opt at its per-token call's."""
    return {graph: (merged_profile(profiles, "all", next((p.name for p in profiles if p.name in CAPTURED_CALLS),
                                                          None)),)
            for graph, profiles in graph_profiles.items()}


def compile_engine(engine_dir: Path, manifest: EngineManifest, build: BuildOptions, options: TensorRTBuild,
                   prepared: dict[str, int]) -> TensorRTCompiled:
    """Build every graph's engine (prepared: the plugin nodes prepare_graph marked, per graph) unless
    --onnx-only; returns engine.json's `build.compile`.

    The timing cache: --timing-cache, kept across builds; default: `timing.cache` in the engine, seeded from the
    engine folder a --force rebuild replaces (build.output) when that has one."""
    graph_profiles = engine_profiles(manifest)
    in_plans = plan_profiles(graph_profiles)
    level = options.builder_optimization_level
    if options.onnx_only:
        plans, timing_cache = None, None
        version = "not built (--onnx-only): written to TensorRT's documented API, not run here"
    else:
        trt = check_installed()
        cache = options.timing_cache or engine_dir / TIMING_CACHE
        seed = build.output / TIMING_CACHE if options.timing_cache is None else None
        plans = {graph: build_plan(trt, engine_dir / entry.file, engine_dir / f"{graph}.plan", in_plans[graph],
                                   level, cache, seed, fp32=manifest.dtype == "fp32")
                 for graph, entry in manifest.graphs.items()}
        version, timing_cache = trt.__version__, str(options.timing_cache) if options.timing_cache else TIMING_CACHE
    return TensorRTCompiled(profiles=graph_profiles, optimization_level=level, plugin_nodes=prepared, plans=plans,
                            tensorrt=version, timing_cache=timing_cache,
                            cuda_graphs=captured_calls(graph_profiles) if options.cuda_graphs else (),
                            plan_profiles=in_plans)


__all__ = ["preflight", "prepare_graph", "mark_aot", "check_installed", "build_plan", "plan_profiles", "compile_engine",
           "TensorRTBuildError"]
