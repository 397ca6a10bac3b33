"""The optimization profiles of shape-specialized backends (TensorRT, MIGraphX): one per kind of engine call the
runtime makes, decided from engine.json's build limits and recorded there, in the order the engine holds them."""
from __future__ import annotations

from v4engine.contract.calls import target_calls
from v4engine.contract.engine import EngineManifest, TensorSpec
from v4engine.contract.profiles import Profile


def profiles(manifest: EngineManifest, graph: str) -> list[Profile]:
    """The runtime's calls of `graph` (contract/calls.py `Call`), as optimization profiles.

    target (each pipeline stage): `prefill` (chunks of up to max_prefill_chunk tokens, verify rows riding along) and
    `verify` (k+1 tokens per row: every decode step); the draft graph: its DraftSpec's calls (MTP: `extend`, a
    prompt's positions in chunks, and `cycle`, the 1..k+1 positions a verify committed; both then draft). Batch
    1..max_batch; block tables of 0..max_seq_len/block_tokens + 1 blocks per row; pools of 1..max_batch slots and
    of 1..the blocks of max_batch rows of max_seq_len (the runtime sizes its pools within those)."""
    chunk = manifest.build["max_prefill_chunk"]
    most = manifest.dim_bounds()             # what engine.json's reader holds recorded profiles to
    draft = manifest.draft_spec
    kinds = draft.calls(manifest.mtp, chunk) if draft is not None and graph == draft.graph else \
        target_calls(manifest.mtp, chunk)
    dims = {"batch": (1, 1, most["batch"]), "blocks": (0, most["blocks"] // 2, most["blocks"]),
            "pool_slots": (1, most["pool_slots"], most["pool_slots"]),
            "pool_blocks": (1, most["pool_blocks"], most["pool_blocks"])}
    out = []
    for name, seq in kinds.items():
        ranges = dims | {"seq": seq}
        shapes = {spec.name: tuple(tuple(d if isinstance(d, int) else ranges[d][i] for d in spec.shape)
                                   for i in range(3))
                  for spec in manifest.graphs[graph].inputs if not _static(spec)}
        out.append(Profile(str(name), shapes))
    return out


def engine_profiles(manifest: EngineManifest) -> dict[str, tuple[Profile, ...]]:
    """Every graph's profiles, as the backends' compile records hold them."""
    return {graph: tuple(profiles(manifest, graph)) for graph in manifest.graphs}


def _static(spec: TensorSpec) -> bool:
    return all(isinstance(d, int) for d in spec.shape)


__all__ = ["profiles", "engine_profiles"]
