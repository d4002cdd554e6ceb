"""The known mistakes of exercises A to E, each a named function. The router, its backward and the
sources' bookkeeping are written out here one step per function; a mistake is one step done wrong,
and exercises/check.py names it when a student's output is exactly what the router with that step
gives on the same inputs. With no step replaced, each written-out form is the project's own code
(tests/test_exercises.py holds them equal)."""
import torch

# ---------------------------------------------------------------- A and B: the router's read


def rms_keys(s, g, eps, heads):
    """RMSNorm_g of each source over its D channels: (B, T, n, D)."""
    return g * s / (s.square().mean(-1, keepdim=True) + eps).sqrt()


def head_scores(keys, w, heads):
    """Head h's score w_h . key_i[h]: (B, T, n, H)."""
    return (keys * w).unflatten(-1, (heads, -1)).sum(-1)


def softmax_over_sources(scores):
    """alpha (B, T, H, n): for each token and head, a softmax over the n sources."""
    return scores.transpose(-1, -2).softmax(dim=-1)


def sum_of_sources(alpha, s, keys, heads):
    """read[h] = sum_i alpha_i^h s_i[h]: (B, T, D)."""
    values = s.unflatten(-1, (heads, -1))                                  # (B, T, n, H, D/H)
    return (alpha.transpose(-1, -2).unsqueeze(-1) * values).sum(-3).flatten(-2)


def contiguous(D, heads):
    """The channel order the heads cut: head h owns channels h*D/H to (h+1)*D/H - 1."""
    return torch.arange(D)


def route(sources, w, g, heads=1, eps=1e-6, keys=rms_keys, scores=head_scores,
          weights=softmax_over_sources, read=sum_of_sources, channels=contiguous):
    """The router with each step a function (a mistake replaces one): read (B, T, D), alpha (B, T,
    H, n)."""
    s = torch.stack(sources, dim=-2)                                       # (B, T, n, D)
    order = channels(s.size(-1), heads)
    s, w, g = s[..., order], w[order], g[order]
    k = keys(s, g, eps, heads)
    alpha = weights(scores(k, w, heads))
    return read(alpha, s, k, heads)[..., order.argsort()], alpha


# the keys done wrong

def gain_forgotten(s, g, eps, heads):
    return s / (s.square().mean(-1, keepdim=True) + eps).sqrt()


def not_normed(s, g, eps, heads):
    return g * s


def mean_subtracted(s, g, eps, heads):
    c = s - s.mean(-1, keepdim=True)
    return g * c / (c.square().mean(-1, keepdim=True) + eps).sqrt()


def eps_missing(s, g, eps, heads):
    return g * s / s.square().mean(-1, keepdim=True).sqrt()


def eps_outside(s, g, eps, heads):
    return g * s / (s.square().mean(-1, keepdim=True).sqrt() + eps)


def l2_norm(s, g, eps, heads):
    return g * s / (s.square().sum(-1, keepdim=True) + eps).sqrt()


def rms_over_the_sources(s, g, eps, heads):
    return g * s / (s.square().mean(-2, keepdim=True) + eps).sqrt()


def one_rms_for_all_sources(s, g, eps, heads):
    return g * s / (s.square().mean((-2, -1), keepdim=True) + eps).sqrt()


def norm_per_head(s, g, eps, heads):
    s_h = s.unflatten(-1, (heads, -1))
    return g * (s_h / (s_h.square().mean(-1, keepdim=True) + eps).sqrt()).flatten(-2)


# the scores done wrong

def scaled_scores(keys, w, heads):
    return head_scores(keys, w, heads) / (keys.size(-1) // heads) ** 0.5


def one_score_for_all_heads(keys, w, heads):
    scores = head_scores(keys, w, heads)
    return scores.sum(-1, keepdim=True).expand_as(scores)


# the softmax over the wrong axis

def softmax_over_batch(scores):
    return scores.transpose(-1, -2).softmax(dim=0)


def softmax_over_tokens(scores):
    return scores.transpose(-1, -2).softmax(dim=1)


def softmax_over_heads(scores):
    return scores.transpose(-1, -2).softmax(dim=-2)


# the read done wrong

def read_of_the_keys(alpha, s, keys, heads):
    return sum_of_sources(alpha, keys, keys, heads)


def mean_of_the_sources(alpha, s, keys, heads):
    return sum_of_sources(alpha, s, keys, heads) / s.size(-2)


def strided(D, heads):
    return torch.arange(D).view(-1, heads).t().flatten()  # head h: channels h, h+H, h+2H, ...


# ---------------------------------------------------------------- E: the router's backward


def softmax_backward(alpha, grad_alpha):
    """dL/dlogit_i = alpha_i (dL/dalpha_i - sum_j alpha_j dL/dalpha_j)."""
    return alpha * (grad_alpha - (alpha * grad_alpha).sum(-1, keepdim=True))


def logit_by_source(w, g, r, logits, s):
    """d logit_i / ds_i = (w * g) r_i - logit_i r_i^2 s_i / D."""
    return w * g * r - logits.unsqueeze(-1) * r.square() * s / s.size(-1)


def source_grad(alpha, G, grad_logits, dlogit_ds):
    """The direct path alpha_i G plus the path through the score."""
    return alpha.unsqueeze(-1) * G.unsqueeze(-2) + grad_logits.unsqueeze(-1) * dlogit_ds


def query_grad(grad_logits, w, s, r, keys):
    return (grad_logits.unsqueeze(-1) * keys).sum((0, 1, 2))


def gain_grad(grad_logits, w, s, r, keys):
    return (grad_logits.unsqueeze(-1) * w * s * r).sum((0, 1, 2))


def backward(sources, w, g, G, eps=1e-6, softmax=softmax_backward, dlogit=logit_by_source,
             grad_s=source_grad, grad_w=query_grad, grad_g=gain_grad):
    """The router's backward with each step a function (a mistake replaces one):
    (dL/ds_i list, dL/dw, dL/dg)."""
    s = torch.stack(sources, dim=-2)                                       # (B, T, n, D)
    r = (s.square().mean(-1, keepdim=True) + eps).rsqrt()                  # 1 / rms(s_i)
    keys = g * s * r
    logits = keys @ w
    alpha = logits.softmax(-1)
    grad_logits = softmax(alpha, (s * G.unsqueeze(-2)).sum(-1))            # dL/dalpha_i = G . s_i
    gs = grad_s(alpha, G, grad_logits, dlogit(w, g, r, logits, s))
    gw, gg = grad_w(grad_logits, w, s, r, keys), grad_g(grad_logits, w, s, r, keys)
    return list(gs.unbind(-2)), gw, gg


def every_sign_flipped(sources, w, g, G, eps=1e-6):
    grad_s, grad_w, grad_g = backward(sources, w, g, G, eps)
    return [-t for t in grad_s], -grad_w, -grad_g


def softmax_second_term_missing(alpha, grad_alpha):
    return alpha * grad_alpha


def softmax_second_term_added(alpha, grad_alpha):
    return alpha * (grad_alpha + (alpha * grad_alpha).sum(-1, keepdim=True))


def r_constant(w, g, r, logits, s):
    return w * g * r


def one_over_D_missing(w, g, r, logits, s):
    return w * g * r - logits.unsqueeze(-1) * r.square() * s


def r_term_added(w, g, r, logits, s):
    return w * g * r + logits.unsqueeze(-1) * r.square() * s / s.size(-1)


def direct_path_missing(alpha, G, grad_logits, dlogit_ds):
    return grad_logits.unsqueeze(-1) * dlogit_ds


def score_path_missing(alpha, G, grad_logits, dlogit_ds):
    return (alpha.unsqueeze(-1) * G.unsqueeze(-2)).expand_as(dlogit_ds)


def query_grad_without_gain(grad_logits, w, s, r, keys):
    return (grad_logits.unsqueeze(-1) * s * r).sum((0, 1, 2))


def gain_grad_without_query(grad_logits, w, s, r, keys):
    return (grad_logits.unsqueeze(-1) * s * r).sum((0, 1, 2))


# ---------------------------------------------------------------- C: the sources' bookkeeping


def right_write(blocks, partial, v, k, L):
    partial = v if partial is None else partial + v
    return (blocks + [partial], None) if k % L == 0 else (blocks, partial)


def right_sources(blocks, partial, route_partial):
    return blocks + [partial] if route_partial and partial is not None else list(blocks)


def official_write(blocks, partial, v, k, L):
    """The official code's bookkeeping: its partial is the stream x (e included, never reset) and a
    completed block appends x - blocks[-1], so the blocks are [e, b1, e+b2, b1+b3, ...]."""
    partial = (blocks[0] if partial is None else partial) + v
    return (blocks + [partial - blocks[-1]] if k % L == 0 else blocks), partial


def minus_last_write(blocks, partial, v, k, L):
    partial = v if partial is None else partial + v
    return (blocks + [partial - blocks[-1]], None) if k % L == 0 else (blocks, partial)


def not_reset_write(blocks, partial, v, k, L):
    partial = v if partial is None else partial + v
    return (blocks + [partial] if k % L == 0 else blocks), partial


def last_only_write(blocks, partial, v, k, L):
    return (blocks + [v], None) if k % L == 0 else (blocks, v)


def partial_always_sources(blocks, partial, route_partial):
    return blocks + [partial] if partial is not None else list(blocks)


def partial_never_sources(blocks, partial, route_partial):
    return list(blocks)
