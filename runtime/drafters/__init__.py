"""Drafters: one module per drafting method behind one interface (base.py), and the only list of them.

`DRAFTERS` maps each method's name to its class: `mtp` (the engine's MTP draft graph), `dspark` (the engine's
DSpark draft graph: the drafter of the current V4 releases), `prompt_lookup` (n-grams of the request's own context,
no weights: any engine). The two with a graph share their cycle (graph.py). A Generator drafts with the engine's own drafter unless told
another (`Generator.from_engine_dir(drafter=...)`, `v4generate --drafter`, the Triton model's `drafter`
parameter). docs/extending.md §1 says how to add one.
"""
from __future__ import annotations

from .base import Drafter, Proposal
from .dspark import DSparkDrafter
from .mtp import MtpDrafter
from .prompt_lookup import PromptLookupDrafter

DRAFTERS: dict[str, type[Drafter]] = {cls.method: cls for cls in (MtpDrafter, DSparkDrafter, PromptLookupDrafter)}

__all__ = ["DRAFTERS", "DSparkDrafter", "Drafter", "MtpDrafter", "PromptLookupDrafter", "Proposal"]
