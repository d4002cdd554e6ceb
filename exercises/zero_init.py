"""Exercise D, the zero-init identity (docs/exercises.md, "Write the router yourself").

A router whose pseudo-query w is zero reads uniformly: every alpha_i = 1/n. Where the sources sum to the
stream x_{k-1}, each sublayer's LayerNorm then gets a positive multiple of the baseline's input, so a routed
model with a baseline's weights and zero queries computes the baseline's function (docs/method.md, section 5).
Check it: make exercise-d (python -m pytest exercises/zero_init.py)
"""
from dataclasses import replace

import torch

from delta_gpt import GPT


def init_router_(router):
    """Set a delta_gpt.Router's pseudo-query router.query (w) and key gain router.norm.weight (g) to their
    init, in place."""
    raise NotImplementedError("init_router_(): set the query to zero and the gain to one, in place (under "
                              "torch.no_grad())")


def convert(baseline, residual, **routing):
    """A GPT of mode `residual` (and GPTConfig's routing options, e.g. n_route_blocks=2) holding the baseline
    GPT's weights, its routers initialised by init_router_()."""
    raise NotImplementedError("convert(): build the routed GPT from the baseline's config, give it the "
                              "baseline's weights, and init every router in model.routers")
