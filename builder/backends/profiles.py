"""The optimization profiles of shape-specialized backends (TensorRT, MIGraphX): one per kind of engine call the
runtime makes, decided from engine.json's build limits and recorded there, in the order the engine holds them."""
from __future__ import annotations

from v4engine.runtime.config import CSA, HCA
from v4engine.runtime.engine import EngineManifest, TensorSpec
from v4engine.runtime.profiles import Profile


def profiles(manifest: EngineManifest, graph: str) -> list[Profile]:
    """The runtime's calls of `graph` (runtime/scheduler.py), as optimization profiles.

    target: `prefill` (chunks of up to max_prefill_chunk tokens, verify rows riding along) and `verify`
    (k+1 tokens per row: every decode step). draft: `extend` (a prompt's positions, in chunks) and `cycle` (the
    1..k+1 positions a verify committed: every decode step); both then run the k draft steps. Batch
    1..max_batch; cached rows of each compressed kind 0..max_seq_len/ratio + 1 (its own ratio: HCA's rows are a
    32nd of CSA's at V4's 4 and 128)."""
    build = manifest.build
    max_batch, chunk, max_seq = build["max_batch"], build["max_prefill_chunk"], build["max_seq_len"]
    cfg = manifest.model
    rows = {kind: max_seq // cfg.compress_rates[layer_kind] + 1 for kind, layer_kind in (("rows_csa", CSA),
                                                                                        ("rows_hca", HCA))}
    if graph == "target":
        kinds = {"prefill": (1, chunk, chunk), "verify": (1, manifest.mtp + 1, manifest.mtp + 1)}
    else:
        kinds = {"extend": (1, chunk, chunk), "cycle": (1, manifest.mtp + 1, manifest.mtp + 1)}
    dims = {"batch": (1, 1, max_batch)} | {kind: (0, n // 2, n) for kind, n in rows.items()}
    out = []
    for name, seq in kinds.items():
        ranges = dims | {"seq": seq}
        shapes = {spec.name: tuple(tuple(d if isinstance(d, int) else ranges[d][i] for d in spec.shape)
                                   for i in range(3))
                  for spec in manifest.graphs[graph].inputs if not _static(spec)}
        out.append(Profile(name, shapes))
    return out


def engine_profiles(manifest: EngineManifest) -> dict[str, tuple[Profile, ...]]:
    """Every graph's profiles, as the backends' compile records hold them."""
    return {graph: tuple(profiles(manifest, graph)) for graph in manifest.graphs}


def _static(spec: TensorSpec) -> bool:
    return all(isinstance(d, int) for d in spec.shape)


__all__ = ["profiles", "engine_profiles"]
