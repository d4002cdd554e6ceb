"""Exercise A, the router's read (docs/exercises.md, "Write the router yourself"). For each token,

    alpha_i = softmax_i(w . RMSNorm_g(s_i))        read = sum_i alpha_i * s_i

with RMSNorm_g(s) = g * s / sqrt(mean(s^2) + eps), the mean over the last dim (the D channels); no 1/sqrt(D).
Check it: make exercise-a (python -m pytest exercises/router_read.py)
"""
import torch


def route(sources, w, g, eps=1e-6):
    """sources: n tensors (B, T, D); w (the query) and g (the gain): (D,).
    Returns read (B, T, D), alpha (B, T, n)."""
    raise NotImplementedError("route(): norm each source into its key, score each key against w, softmax "
                              "the scores over the sources, and return the weighted sum of the sources and "
                              "the weights")
