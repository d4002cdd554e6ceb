"""Exercise E, the router's backward by hand (docs/exercises.md, "Write the router yourself"). The forward,
one head:

    r_i = 1 / sqrt(mean(s_i^2) + eps)    key_i = g * s_i * r_i    logit_i = w . key_i
    alpha = softmax(logits) over the sources          read = sum_i alpha_i * s_i

Given grad_read = dL/dread, return dL/ds_i, dL/dw and dL/dg, the last two summed over every token (as
autograd does). Check it: make exercise-e (python -m pytest exercises/router_backward.py)
"""
import torch


def route_backward(sources, w, g, grad_read, eps=1e-6):
    """sources: n tensors (B, T, D); w, g: (D,); grad_read: (B, T, D).
    Returns (grad_sources: a list of n tensors (B, T, D), grad_w (D,), grad_g (D,))."""
    raise NotImplementedError("route_backward(): recompute the forward, then go back through the read, the "
                              "softmax and the scores to the sources, w and g")
