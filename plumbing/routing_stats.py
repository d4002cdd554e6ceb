"""Routing statistics of a routed GPT: per routed sublayer, how sharp its weights are (max weight, entropy), how
they spread over the sources, and how alike adjacent sources are. train.py logs them at each evaluation;
`cli.py report` tables and draws them (workbench/report.py)."""
import math

import torch
from torch.nn import functional as F

from errors import DeltaGPTError


@torch.no_grad()
def routing_stats(model, idx):
    """Routing statistics of a routed GPT on a batch idx (B, T), from the record of each router's sources
    and weights, per routed sublayer in order (the final router last): n sources, max_weight (mean over
    tokens of max_i alpha_i; uniform gives 1/n), entropy (H / log n), mean_weight (mean alpha per source),
    adj_cos (mean cosine similarity of adjacent sources). Averages leave out sublayers with one source;
    deep_* average the deeper half of the sublayers. source_names: the sources' names, in order."""
    cfg = model.config
    if cfg.residual == "baseline":
        raise DeltaGPTError("a baseline model has no routing to report; train or convert a routed model "
                         "(--residual attnres, delta or delta_block)")
    record = []
    model.hidden(idx, record=record)
    rows = [sublayer_row(name, k, sources, alpha)
            for k, (name, (sources, alpha)) in enumerate(zip(sublayer_names(cfg), record), start=1)]
    multi = [r for r in rows if r["n"] > 1]
    deep = [r for r in multi if r["index"] > cfg.n_sublayers // 2]
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs) if rs else float("nan")
    return dict(
        sublayers=rows,
        mean_max_weight=mean(multi, "max_weight"), mean_entropy=mean(multi, "entropy"),
        deep_max_weight=mean(deep, "max_weight"), deep_entropy=mean(deep, "entropy"),
        mean_adj_cos=mean(multi, "adj_cos"), source_names=source_names(cfg),
    )


def sublayer_row(name, k, sources, alpha):
    """One sublayer's statistics from its sources (n tensors (B, T, D)) and weights alpha (B, T, H, n): each
    statistic is the mean over the H routing heads, and `heads` has each head's."""
    cos = [F.cosine_similarity(a.float(), b.float(), dim=-1).mean().item() for a, b in zip(sources, sources[1:])]
    row = dict(name=name, index=k, **weight_stats(alpha), adj_cos=sum(cos) / len(cos) if cos else float("nan"))
    row["heads"] = [weight_stats(alpha[:, :, h]) for h in range(alpha.size(2))]
    return row


def weight_stats(alpha):
    """n, uniform 1/n, max_weight, entropy / log n and mean_weight of routing weights alpha (..., n)."""
    n = alpha.size(-1)
    entropy = -(alpha * alpha.clamp_min(1e-30).log()).sum(-1)
    return dict(
        n=n, uniform=1.0 / n,
        max_weight=alpha.max(-1).values.mean().item(),
        entropy=(entropy / math.log(n)).mean().item() if n > 1 else float("nan"),
        mean_weight=alpha.reshape(-1, n).mean(0).tolist(),
    )


def sublayer_names(cfg):
    """h.0.attn, h.0.mlp, h.1.attn, ..., and "final" for attnres's final router."""
    names = [f"h.{i}.{kind}" for i in range(cfg.n_layer) for kind in ("attn", "mlp")]
    return names + (["final"] if cfg.residual == "attnres" else [])


def source_names(cfg):
    """The sources in order: e, then v1, v2, ... per sublayer or b1, b2, ... per block (a block's partial
    sum sits where the block will); for cumulative sources x1, x2, ... or x_b1, x_b2, ..., the stream
    after sublayer or block j."""
    piece = "v" if cfg.n_route_blocks == cfg.n_sublayers else "b"
    if cfg.route_sources == "cumulative":
        piece = "x" if piece == "v" else "x_b"
    return ["e"] + [f"{piece}{j}" for j in range(1, cfg.n_route_blocks + 1)]
