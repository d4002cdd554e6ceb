"""The reference answers of the exercises in exercises/, each function as docs/exercises.md shows it
(collapsed): tests/test_exercises.py fills every stub with these, requires every check to pass, and holds the
page's answers equal to these functions."""
from dataclasses import replace

import torch

from delta_gpt import GPT


def route(sources, w, g, eps=1e-6):
    s = torch.stack(sources, dim=-2)                                 # (B, T, n, D)
    keys = g * s / (s.square().mean(-1, keepdim=True) + eps).sqrt()  # RMSNorm_g(s_i)
    alpha = (keys @ w).softmax(dim=-1)                               # (B, T, n): over the sources, per token
    read = (alpha.unsqueeze(-1) * s).sum(-2)                         # sum_i alpha_i s_i
    return read, alpha


def route_heads(sources, w, g, heads, eps=1e-6):
    s = torch.stack(sources, dim=-2)                                 # (B, T, n, D)
    keys = g * s / (s.square().mean(-1, keepdim=True) + eps).sqrt()  # normed over the full width D, then cut
    keys, s = keys.unflatten(-1, (heads, -1)), s.unflatten(-1, (heads, -1))  # (B, T, n, H, D/H)
    alpha = (keys * w.view(heads, -1)).sum(-1).softmax(dim=-2)       # w_h . key_i[h], softmax over sources
    read = (alpha.unsqueeze(-1) * s).sum(-3).flatten(-2)             # read[h] = sum_i alpha_i^h s_i[h]
    return read, alpha.transpose(-1, -2)                             # alpha (B, T, H, n)


def write(blocks, partial, v, k, block_len):
    partial = v if partial is None else partial + v
    if k % block_len == 0:  # the block is complete: its sum becomes a source and the next block starts empty
        return blocks + [partial], None
    return blocks, partial


def sources(blocks, partial, route_partial):
    return blocks + [partial] if route_partial and partial is not None else list(blocks)


def init_router_(router):
    with torch.no_grad():
        router.query.zero_()           # w = 0: every score is 0, every alpha_i = 1/n
        router.norm.weight.fill_(1.0)  # g = 1: w's gradient, the key g * RMSNorm(s_i), is not zero


def convert(baseline, residual, **routing):
    model = GPT(replace(baseline.config, residual=residual, **routing))
    model.load_state_dict(baseline.state_dict(), strict=False)  # all weights but the routers', which it lacks
    for router in model.routers:
        init_router_(router)
    return model


def route_backward(sources, w, g, grad_read, eps=1e-6):
    s = torch.stack(sources, dim=-2)                                 # (B, T, n, D)
    r = (s.square().mean(-1, keepdim=True) + eps).rsqrt()            # 1 / rms(s_i), (B, T, n, 1)
    keys = g * s * r
    logits = keys @ w
    alpha = logits.softmax(dim=-1)                                   # the forward again, (B, T, n)
    grad_alpha = (s * grad_read.unsqueeze(-2)).sum(-1)               # read = sum_i alpha_i s_i
    grad_logits = alpha * (grad_alpha - (alpha * grad_alpha).sum(-1, keepdim=True))  # softmax backward
    # logit_i = (w * g) . s_i * r_i with dr_i/ds_i = -r_i^3 s_i / D
    dlogit_ds = w * g * r - logits.unsqueeze(-1) * r.square() * s / s.size(-1)
    grad_s = alpha.unsqueeze(-1) * grad_read.unsqueeze(-2) + grad_logits.unsqueeze(-1) * dlogit_ds
    grad_w = (grad_logits.unsqueeze(-1) * keys).sum((0, 1, 2))
    grad_g = (grad_logits.unsqueeze(-1) * w * s * r).sum((0, 1, 2))
    return list(grad_s.unbind(-2)), grad_w, grad_g
