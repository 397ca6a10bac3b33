"""Drafters: one module per drafting method behind one interface (base.py), and the only list of them.

`DRAFTERS` maps each method's name to its class: `mtp` (the engine's MTP draft graph), `prompt_lookup` (n-grams of
the request's own context, no weights: any engine). A Generator drafts with the engine's own drafter unless told
another (`Generator.from_engine_dir(drafter=...)`, `v4generate --drafter`, the Triton model's `drafter`
parameter). docs/extending.md §1 says how to add one.
"""
from __future__ import annotations

from .base import Drafter, Proposal
from .mtp import MtpDrafter
from .prompt_lookup import PromptLookupDrafter

DRAFTERS: dict[str, type[Drafter]] = {cls.method: cls for cls in (MtpDrafter, PromptLookupDrafter)}

__all__ = ["DRAFTERS", "Drafter", "MtpDrafter", "PromptLookupDrafter", "Proposal"]
