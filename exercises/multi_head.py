"""Exercise B, multi-head routing (docs/exercises.md, "Write the router yourself"). For each token and head h,

    alpha_i^h = softmax_i(w_h . RMSNorm_g(s_i)[h])        read[h] = sum_i alpha_i^h * s_i[h]

where [h] is channel group h: the D channels cut into H contiguous groups of D/H (group h holds channels
h*D/H to (h+1)*D/H - 1), and w_h is group h of w. The RMSNorm is over the full width D, then cut into groups.
Check it: make exercise-b (python -m pytest exercises/multi_head.py)
"""
import torch


def route_heads(sources, w, g, heads, eps=1e-6):
    """sources: n tensors (B, T, D); w, g: (D,); heads H divides D.
    Returns read (B, T, D), alpha (B, T, H, n)."""
    raise NotImplementedError("route_heads(): the keys RMSNorm_g(s_i) over the full width, cut into H "
                              "groups; each head's scores w_h . key_i[h] and their softmax over the sources; "
                              "each head's read of its own channels")
