"""The model's claims, pinned: zero-init identities, what the sources are, the fast path computes the plain
path's numbers, activation memory linear in depth, recompute changes no gradient, causality, KV cache ==
recompute, checkpoints and state_dict names, optimizer groups, config errors."""
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from delta_gpt import GPT, GPTConfig, RESIDUALS, LayerNorm, Router, RouteRead, Score, folded_queries, is_routing_key
from plumbing import checkpoint as CK
from workbench.bench import saved_bytes  # bytes autograd saves for backward, each storage once, parameters left out

VOCAB = 61
ROUTED = [m for m in RESIDUALS if m != "baseline"]
DATA = Path(__file__).resolve().parent / "data"


def tiny(residual="baseline", **kw):
    kw = dict(dict(block_size=64, vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=64, dropout=0.0), **kw)
    return GPTConfig(residual=residual, **kw)


def model_of(config, seed=0, queries=0.0):
    """A model in eval mode; queries > 0 gives routers random non-zero queries and gains."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    if queries:
        with torch.no_grad():
            for router in model.routers:
                if hasattr(router, "logits"):  # a static router: one logit per source
                    router.logits.normal_(0, queries)
                    continue
                router.query.normal_(0, queries)
                router.norm.weight.uniform_(0.5, 1.5)
    return model


def unit_gain_(model):
    """Embeddings std 1 and other matrices std 1/sqrt(fan_in), so the stream's variance is far above LN eps."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_routing_key(name):
                continue
            if "wte" in name or "wpe" in name:
                p.normal_(0, 1.0)
            elif p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.size(1)))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def idx_batch(B=2, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, T), generator=g)


def routed_copy(base, residual, **kw):
    """A routed model with the baseline's weights and zero-init routing."""
    model = GPT(replace(base.config, residual=residual, **kw)).eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(is_routing_key(k) for k in missing)
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def logits_and_grads(model, idx):
    """Logits and every parameter's gradient of the loss on idx (targets idx), by parameter name (a compiled
    model's names without their _orig_mod. prefix). No gradient counts as zero (a router with one source
    has none on the fast path)."""
    model.zero_grad()
    logits, loss = model(idx, idx)
    loss.backward()
    return logits, {n.removeprefix("_orig_mod."): torch.zeros_like(p) if p.grad is None else p.grad.clone()
                    for n, p in model.named_parameters()}


def router_inputs(n=3, B=2, T=3, D=8, dtype=torch.float64, heads=1):
    torch.manual_seed(0)
    router = Router(D, heads).to(dtype)
    with torch.no_grad():
        router.query.normal_(0, 1.0)
        router.norm.weight.uniform_(0.5, 1.5)
    sources = [(torch.randn(B, T, D, dtype=dtype) * (i + 1)).requires_grad_() for i in range(n)]
    return router, sources


# ---------------------------------------------------------------- zero-init: the routed modes compute the baseline

IDENTITY_CASES = [("attnres", dict(n_route_blocks=n)) for n in (1, 2, 4, 8)] + [
    ("delta", {}),
    ("delta_block", dict(route_partial=True, n_route_blocks=1)),
    ("delta_block", dict(route_partial=True, n_route_blocks=2)),
    ("delta_block", dict(route_partial=True, n_route_blocks=4)),
    ("delta_block", dict(route_partial=True, n_route_blocks=8)),
]


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("weights", ["dynamic", "static"])
@pytest.mark.parametrize("residual,kw", IDENTITY_CASES)
def test_zero_init_equals_baseline(residual, kw, weights, heads):
    base = unit_gain_(model_of(tiny()))
    idx = idx_batch()
    ref, _ = base(idx)
    routed = routed_copy(base, residual, route_weights=weights, route_heads=heads, **kw)
    out, _ = routed(idx)
    # replacement routing feeds x/n into LN, which weighs LN eps about n^2 more (docs/method.md)
    assert rel_err(out, ref) < (1e-4 if residual == "attnres" else 5e-6)


@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize("weights", ["dynamic", "static"])
@pytest.mark.parametrize("residual,kw", IDENTITY_CASES)
def test_zero_init_exact_without_ln_eps(residual, kw, weights, heads):
    base = unit_gain_(model_of(tiny())).double()
    for m in base.modules():
        if isinstance(m, LayerNorm):
            m.eps = 0.0
    routed = routed_copy(base, residual, route_weights=weights, route_heads=heads, **kw).double()
    for m in routed.modules():
        if isinstance(m, LayerNorm):
            m.eps = 0.0
    idx = idx_batch()
    assert rel_err(routed(idx)[0], base(idx)[0]) < 1e-12


@pytest.mark.parametrize("n_route_blocks", [1, 2, 4])
def test_plain_delta_block_is_not_identity_at_init(n_route_blocks):
    base = unit_gain_(model_of(tiny()))
    idx = idx_batch()
    routed = routed_copy(base, "delta_block", n_route_blocks=n_route_blocks)
    assert rel_err(routed(idx)[0], base(idx)[0]) > 1e-3


def test_zero_init_loss_equal_at_gpt2_init():
    """At GPT-2's own init (std 0.02) the stream's variance is near LN eps: the additive modes still give
    the baseline's loss closely; replacement routing (x/n into LN) does not (docs/method.md)."""
    base = model_of(tiny())
    idx = idx_batch()
    _, ref = base(idx, idx)
    additive = [abs(routed_copy(base, r, route_partial=True)(idx, idx)[1].item() - ref.item())
                for r in ("delta", "delta_block")]
    replacement = abs(routed_copy(base, "attnres")(idx, idx)[1].item() - ref.item())
    assert max(additive) < 1e-3 < replacement


# ---------------------------------------------------------------- the router is its formula, its weights a simplex

def test_router_is_its_formula():
    """Router: alpha = softmax_i(w . RMSNorm_g(s_i)), read = sum_i alpha_i s_i, written out per source."""
    router, sources = router_inputs(n=3)
    read, alpha = router(sources)
    logits = torch.stack([(F.rms_norm(s, (8,), eps=1e-6) * router.norm.weight) @ router.query for s in sources], -1)
    assert alpha.shape == (2, 3, 1, 3)  # (B, T, H, n) for every H, one head here
    torch.testing.assert_close(alpha[..., 0, :], logits.softmax(-1))
    torch.testing.assert_close(read, sum(alpha[..., 0, i:i + 1] * s for i, s in enumerate(sources)))


def test_one_head_router_is_the_single_head_formula():
    """H = 1 is the single-head router: the plain path (Router) equals the stacked one-head formula in float64 to
    rounding; the fast path's read (RouteRead) is the same loop of multiply-adds, to the last bit."""
    router, sources = router_inputs(n=4, D=16)
    read, alpha = router(sources)
    s = torch.stack(sources, dim=-2)
    ref_alpha = (F.rms_norm(s, (16,), router.norm.weight, 1e-6) @ router.query).softmax(-1)
    torch.testing.assert_close(alpha[..., 0, :], ref_alpha, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(read, (ref_alpha.unsqueeze(-1) * s).sum(-2), rtol=1e-14, atol=1e-14)
    sources = [s.float() for s in sources]
    logits = fast_logits(folded_queries([router.float()]), sources)[..., 0]  # (n, B, T)
    fast_read, fast_alpha = RouteRead.apply(False, None, logits.unsqueeze(-1), None, *sources)
    a = logits.softmax(0).unsqueeze(-1)
    ref_read = a[0] * sources[0]
    for a_i, s_i in zip(a[1:], sources[1:]):
        ref_read.addcmul_(a_i, s_i)
    assert torch.equal(fast_alpha[..., 0], logits.softmax(0)) and torch.equal(fast_read, ref_read)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_score_is_its_formula(heads):
    """Score (phase 1): block s's logit for each of R routers, (Q[j, h] . s[h]) / rms(s) per channel group h,
    the rms over the full width; RouteRead scores a partial against one query the same way (phase 2)."""
    _, sources = router_inputs(n=2, D=16)
    Q = torch.randn(3, 16, dtype=torch.float64)
    r = (sources[0].square().mean(-1) + 1e-6).rsqrt()
    ref = torch.stack([torch.stack([(sources[0][..., g] * Q[j, g]).sum(-1) * r for g in torch.arange(16).chunk(heads)], -1)
                       for j in range(3)])  # (R, B, T, H)
    torch.testing.assert_close(torch.stack(Score.apply(sources[0], Q, heads)), ref)
    logits = torch.randn(1, 2, 3, heads, dtype=torch.float64)
    _, alpha = RouteRead.apply(False, None, logits, Q[1], sources[1], sources[0])
    torch.testing.assert_close(alpha, torch.cat([logits, ref[1:2]]).softmax(0))


@pytest.mark.parametrize("heads", [2, 4])
def test_multi_head_router_is_its_formula(heads):
    """Multi-head routing, written out per head h on channel group h: alpha^h = softmax_i(w_h . RMSNorm_g(s_i)[h])
    with the RMSNorm over the full width, read[h] = sum_i alpha^h_i s_i[h]."""
    router, sources = router_inputs(n=3, D=8, heads=heads)
    read, alpha = router(sources)
    assert alpha.shape == (2, 3, heads, 3)
    keys = [F.rms_norm(s, (8,), eps=1e-6) * router.norm.weight for s in sources]  # full width, then sliced
    for h, group in enumerate(torch.arange(8).chunk(heads)):
        logits = torch.stack([k[..., group] @ router.query[group] for k in keys], -1)
        torch.testing.assert_close(alpha[..., h, :], logits.softmax(-1))
        torch.testing.assert_close(read[..., group], sum(alpha[..., h, i:i + 1] * s[..., group] for i, s in enumerate(sources)))


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_head_scores_sum_to_the_one_head_score(heads):
    """The keys are normed over the full width, so a source's H head scores add up to its one-head score."""
    _, sources = router_inputs(n=1, D=8)
    Q = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(torch.stack(Score.apply(sources[0], Q, heads)).sum(-1),
                               torch.stack(Score.apply(sources[0], Q, 1))[..., 0])


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("residual", ROUTED)
def test_routing_weights_are_a_simplex(residual, heads):
    model = model_of(tiny(residual, route_heads=heads), queries=2.0)
    record = []
    with torch.no_grad():
        model.hidden(idx_batch(), record=record)
    assert [alpha.size(-1) for _, alpha in record] == model.sources_per_router()
    assert all(alpha.shape[:-1] == (2, 32, heads) for _, alpha in record)
    for sources, alpha in record:
        assert len(sources) == alpha.size(-1) and (alpha >= 0).all()
        torch.testing.assert_close(alpha.sum(-1), torch.ones(alpha.shape[:-1]))


# ---------------------------------------------------------------- the sources are the stream's pieces

def record_run(model, idx):
    """Each router's sources, and e plus every sublayer output v_k, from one forward."""
    outputs = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: outputs.append(out))
             for b in model.transformer.h for m in (b.attn, b.mlp)]
    record = []
    with torch.no_grad():
        model.hidden(idx, record=record)
    for h in hooks:
        h.remove()
    pos = torch.arange(idx.size(1))
    e = model.transformer.wte(idx) + model.transformer.wpe(pos)
    return record, e, outputs


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("residual,kw", [
    ("attnres", dict(n_route_blocks=2)), ("attnres", dict(n_route_blocks=8)), ("delta", {}),
    ("delta_block", dict(route_partial=True)), ("delta_block", dict(n_route_blocks=2, route_partial=True)),
])
def test_sources_sum_to_stream(residual, kw, fast):
    model = model_of(tiny(residual, fast_routing=fast, **kw), queries=1.0)
    record, e, v = record_run(model, idx_batch())
    S = model.config.n_sublayers
    assert len(record) == S + (residual == "attnres")
    for k, (sources, _) in enumerate(record, start=1):
        x_prev = e + sum(v[:k - 1])  # x_{k-1} = e + v_1 + ... + v_{k-1}
        torch.testing.assert_close(sum(sources), x_prev, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_route_blocks", [1, 2, 4])
def test_plain_delta_block_sources_are_block_deltas(n_route_blocks):
    """Without the partial, sublayer k reads [e, b_1, ..., b_{m-1}]: b_j is exactly block j's sum of v's
    (not the official code's partial - blocks[-1]); they sum to the block-start stream."""
    model = model_of(tiny("delta_block", n_route_blocks=n_route_blocks), queries=1.0)
    record, e, v = record_run(model, idx_batch())
    L = model.config.n_sublayers // n_route_blocks
    for k, (sources, _) in enumerate(record, start=1):
        m = (k - 1) // L  # completed blocks
        assert len(sources) == 1 + m
        torch.testing.assert_close(sources[0], e)
        for j in range(1, m + 1):
            torch.testing.assert_close(sources[j], sum(v[(j - 1) * L:j * L]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("residual", ["attnres", "delta_block"])
def test_cumulative_sources_are_stream_snapshots(residual):
    model = model_of(tiny(residual, n_route_blocks=4, route_partial=True, route_sources="cumulative"), queries=1.0)
    record, e, v = record_run(model, idx_batch())
    L = 2
    for k, (sources, _) in enumerate(record[:model.config.n_sublayers], start=1):
        m = (k - 1) // L
        for j in range(m + 1):
            torch.testing.assert_close(sources[j], e + sum(v[:j * L]), atol=1e-5, rtol=1e-5)
        if (k - 1) % L:  # the partial becomes the current stream x_{k-1}
            torch.testing.assert_close(sources[-1], e + sum(v[:k - 1]), atol=1e-5, rtol=1e-5)


def test_delta_block_with_N_equal_S_is_delta():
    delta = model_of(tiny("delta"), queries=1.0)
    block = GPT(tiny("delta_block", n_route_blocks=8)).eval()
    block.load_state_dict(delta.state_dict())
    idx = idx_batch()
    torch.testing.assert_close(block(idx)[0], delta(idx)[0], atol=0, rtol=0)


# ---------------------------------------------------------------- the fast path computes the plain path's numbers

def fast_logits(Q, sources, heads=1):
    """Each source's phase-1 logits for one router, Score against its folded query Q (1, D): (n, B, T, H)."""
    return torch.stack([Score.apply(s, Q, heads)[0] for s in sources])


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_score_gradcheck(heads):
    router, sources = router_inputs()
    Q = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)  # three routers' folded queries
    assert torch.autograd.gradcheck(lambda s, Q: Score.apply(s, Q, heads), (sources[0], Q))
    # a router that did not read the block: its gradient is None
    assert torch.autograd.gradcheck(lambda s, Q: Score.apply(s, Q, heads)[1] * 2, (sources[0], Q))


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("partial", [False, True])
def test_route_read_gradcheck(partial, additive, heads):
    """RouteRead's written-out backward, float64 gradcheck; with a query its last source is a partial sum it
    scores itself (phase 2), so the gradient also reaches the query and the partial through its logit."""
    _, sources = router_inputs(n=4)
    logits = torch.randn(3 if partial else 4, 2, 3, heads, dtype=torch.float64, requires_grad=True)
    base = torch.randn_like(sources[0]).requires_grad_() if additive else None
    query = torch.randn(8, dtype=torch.float64, requires_grad=True) if partial else None
    assert torch.autograd.gradcheck(lambda *a: RouteRead.apply(False, *a)[0], (base, logits, query, *sources))


@pytest.mark.parametrize("heads", [1, 2])
def test_handed_on_chain_gradcheck(heads):
    """Three routers in a row, each handing its sources on as aliases to the next, which adds its share
    into their gradient in place; the second also scores a partial sum, the last reads a new source.
    Float64 gradcheck of the chain."""
    _, sources = router_inputs(n=4)
    logits = [torch.randn(n, 2, 3, heads, dtype=torch.float64, requires_grad=True) for n in (2, 2, 3)]
    query = torch.randn(8, dtype=torch.float64, requires_grad=True)

    def chain(l1, l2, l3, q, s1, s2, s3, p):
        r1, _, *h = RouteRead.apply(True, None, l1, None, s1, s2)
        r2, _, *h = RouteRead.apply(True, s1, l2, q, *h, p)
        r3, _, *_ = RouteRead.apply(True, None, l3, None, *h, s3)
        return r1 * 0.5 + r2 * torch.cos(r2) + r3 * r1

    assert torch.autograd.gradcheck(chain, (*logits, query, *sources))


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("n", [2, 5])
def test_score_and_route_read_equal_router(n, partial, additive, heads):
    """Score against the folded query, then RouteRead (the read added onto a base x when additive; with a
    partial, the last source scored by RouteRead itself), gives Router's read and alpha, and the same
    gradients for the query, the gain, the sources and x."""
    router, sources = router_inputs(n=n, D=16, heads=heads)
    base = torch.randn_like(sources[0]).requires_grad_() if additive else None
    wrt = [router.query, router.norm.weight, *sources] + ([base] if additive else [])

    def grads(read):
        return torch.autograd.grad((read * torch.cos(read)).sum(), wrt)

    Q = folded_queries([router])
    scored = sources[:-1] if partial else sources
    read, alpha, *_ = RouteRead.apply(False, base, fast_logits(Q, scored, heads), Q[0] if partial else None, *sources)
    ref, alpha_ref = router(sources)
    ref = ref if base is None else base + ref
    torch.testing.assert_close(read, ref)
    torch.testing.assert_close(alpha.movedim(0, -1), alpha_ref)
    for g, g_ref in zip(grads(read), grads(ref)):
        torch.testing.assert_close(g, g_ref)


EVERY_MODE_AND_N = [("baseline", {})] + [("attnres", dict(n_route_blocks=n)) for n in (1, 2, 4, 8)] + [("delta", {})] + [
    ("delta_block", dict(n_route_blocks=n, route_partial=p)) for n in (1, 2, 4, 8) for p in (False, True)] + [
    ("delta_block", dict(route_partial=True, route_sources="cumulative")),
    ("attnres", dict(n_route_blocks=2, route_sources="cumulative")),
    ("delta", dict(route_sources="cumulative")),
]


@pytest.mark.parametrize("residual,kw,weights,heads", [
    (r, kw, w, h) for r, kw in EVERY_MODE_AND_N for w in (("dynamic", "static") if r != "baseline" else (None,))
    for h in ((1, 4) if r != "baseline" else (None,))])
def test_fast_routing_equals_plain(residual, kw, weights, heads):
    """Whole-model logits and every gradient, float64, fast_routing on and off, dynamic and static routing, one
    and four routing heads."""
    model = model_of(tiny(residual, route_weights=weights, route_heads=heads, **kw), queries=1.0).double()
    idx = idx_batch()
    logits, grads = logits_and_grads(model, idx)
    model.config.fast_routing = False
    logits_ref, grads_ref = logits_and_grads(model, idx)
    torch.testing.assert_close(logits, logits_ref)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], msg=name)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("residual,kw", [("delta", {}), ("attnres", dict(n_route_blocks=2)), ("delta_block", {})])
def test_static_weights_do_not_depend_on_the_input(residual, kw, fast, heads):
    """Static routing: each router's weights are softmax(b) (per head) for every token of every input; dynamic's are not."""
    model = model_of(tiny(residual, route_weights="static", route_heads=heads, fast_routing=fast, **kw), queries=1.0)
    records = []
    for seed in (1, 2):
        records.append([])
        with torch.no_grad():
            model.hidden(idx_batch(seed=seed) if seed == 1 else idx_batch(B=3, T=17, seed=seed), record=records[-1])
    assert len(records[0]) == len(model.routers)
    for router, (_, alpha1), (_, alpha2) in zip(model.routers, *records):
        weights = router.logits.detach().softmax(-1)
        assert alpha1.shape[-1] == alpha2.shape[-1] == router.logits.size(-1) and router.logits.numel() == heads * alpha1.shape[-1]
        torch.testing.assert_close(alpha1, weights.expand_as(alpha1))
        torch.testing.assert_close(alpha2, weights.expand_as(alpha2))
    dynamic = model_of(tiny(residual, fast_routing=fast, **kw), queries=1.0)
    record = []
    with torch.no_grad():
        dynamic.hidden(idx_batch(), record=record)
    assert any(alpha.shape[-1] > 1 and not torch.allclose(alpha, alpha[:1, :1].expand_as(alpha)) for _, alpha in record)


def test_static_routers_hold_one_logit_per_source_and_no_query():
    model = GPT(tiny("delta_block", route_weights="static", route_partial=True))
    assert [r.logits.numel() for r in model.routers] == model.sources_per_router()
    heads = GPT(tiny("delta_block", route_weights="static", route_partial=True, route_heads=4))
    assert [tuple(r.logits.shape) for r in heads.routers] == [(4, n) for n in model.sources_per_router()]
    assert all(not hasattr(r, "query") and not hasattr(r, "norm") for r in model.routers)
    assert all(is_routing_key(k) for k in model.state_dict() if "logits" in k)
    assert sum(p.numel() for p in model.route_parameters()) == sum(model.sources_per_router())


def test_recorded_sources_get_the_plain_paths_gradients():
    """Recorded sources are the sources themselves, not the fast path's handed-on aliases: a loss that
    also uses them, so that autograd sums into the sources' gradients, gets the plain path's gradients."""
    model = model_of(tiny("delta"), queries=1.0).double()

    def grads(fast):
        model.config.fast_routing = fast
        model.zero_grad()
        record = []
        x = model.hidden(idx_batch(), record=record)
        (x.square().mean() + sum(s.sum() for sources, _ in record for s in sources)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    fast, ref = grads(True), grads(False)
    for name in fast:
        torch.testing.assert_close(fast[name], ref[name], msg=name)


@pytest.mark.parametrize("fast", [True, False])
def test_logits_and_softmax_in_float32_under_autocast(fast):
    model = model_of(tiny("delta", n_layer=2, fast_routing=fast), queries=1.0)
    record = []
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model.hidden(idx_batch(T=8), record=record)
    assert all(alpha.dtype == torch.float32 for _, alpha in record)
    assert any(s.dtype == torch.bfloat16 for sources, _ in record for s in sources)


def test_fast_pieces_under_bf16_autocast_match_float64():
    """Mixed sources (an fp32 embedding, bf16 sublayer outputs, the last a partial sum that RouteRead scores)
    under bf16 autocast: Score and RouteRead's outputs and gradients match the float64 Router to bf16
    rounding, and alpha is float32 (computed, not cast, in float32)."""
    router, sources = router_inputs(n=4, B=2, T=5, D=32, dtype=torch.float32)
    mixed = [sources[0]] + [s.detach().bfloat16().requires_grad_() for s in sources[1:]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Q = folded_queries([router])
        read, alpha, *_ = RouteRead.apply(False, None, fast_logits(Q, mixed[:-1]), Q[0], *mixed)
    assert alpha.dtype == torch.float32
    (read.float() * torch.linspace(-1, 1, 32)).sum().backward()
    ref = Router(32).double()
    ref.load_state_dict(router.state_dict())
    exact = [s.detach().double().requires_grad_() for s in mixed]
    read64, alpha64 = ref(exact)
    (read64 * torch.linspace(-1, 1, 32, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(alpha.movedim(0, -1).double(), alpha64, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(read.double(), read64, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(router.query.grad.double(), ref.query.grad, atol=1e-5, rtol=1e-4)
    for s, s64 in zip(mixed, exact):
        torch.testing.assert_close(s.grad.double(), s64.grad, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("residual", ROUTED)
def test_fast_routing_equals_plain_under_bf16_autocast(residual, heads):
    """Whole-model logits and gradients under bf16 autocast agree to bf16 rounding (measured: at most 2%
    of a gradient's norm, where either differs from float64 by up to 90%)."""
    model = unit_gain_(model_of(tiny(residual, n_layer=2, route_heads=heads), seed=1, queries=1.0))
    idx = idx_batch(T=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, grads = logits_and_grads(model, idx)
        model.config.fast_routing = False
        logits_ref, grads_ref = logits_and_grads(model, idx)
    close = lambda a, b, tol: (a.float() - b.float()).norm() <= tol * b.float().norm()  # within tol of b's norm
    assert close(logits, logits_ref, 1e-2)
    for name in grads:
        assert close(grads[name], grads_ref[name], 5e-2), name


def test_manual_attention_equals_sdpa():
    model = model_of(tiny("delta"), queries=1.0)
    idx = idx_batch()
    fast, _ = model(idx)
    for b in model.transformer.h:
        b.attn.flash = False
    slow, _ = model(idx)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.compile
@pytest.mark.parametrize("residual,heads", [("delta", None), ("attnres", None), ("delta_block", 4)])
def test_compiled_fast_routing_equals_eager_plain(residual, heads):
    """torch.compile(fullgraph=True) of the fast path gives the eager plain path's logits and gradients."""
    model = model_of(tiny(residual, n_layer=2, n_route_blocks=2 if residual == "attnres" else None, route_heads=heads),
                     queries=1.0)
    idx = idx_batch(T=16)
    model.config.fast_routing = False
    eager_logits, eager_grads = logits_and_grads(model, idx)
    model.config.fast_routing = True
    torch._dynamo.reset()
    logits, grads = logits_and_grads(torch.compile(model, fullgraph=True), idx)
    torch._dynamo.reset()
    torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5)
    for name in eager_grads:
        torch.testing.assert_close(grads[name], eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.compile
@pytest.mark.parametrize("residual,kw", [m for m in EVERY_MODE_AND_N if m[0] != "baseline"])
def test_fast_routing_traced_by_torch_compile_equals_plain(residual, kw):
    """Every mode and block count: torch.compile(fullgraph=True) traces the fast path whole (the custom
    autograd Functions included) and, run through AOT autograd without Inductor's code generation (which the
    test above covers for two modes), gives the plain path's logits and gradients, in float64 as above."""
    model = model_of(tiny(residual, **kw), queries=1.0).double()
    idx = idx_batch(T=16)
    model.config.fast_routing = False
    eager_logits, eager_grads = logits_and_grads(model, idx)
    model.config.fast_routing = True
    torch._dynamo.reset()
    logits, grads = logits_and_grads(torch.compile(model, fullgraph=True, backend="aot_eager"), idx)
    torch._dynamo.reset()
    torch.testing.assert_close(logits, eager_logits)
    for name in eager_grads:
        torch.testing.assert_close(grads[name], eager_grads[name], msg=name)


# ---------------------------------------------------------------- activation memory is linear in depth

def test_activation_memory_linear_in_depth():
    """Saved-for-backward bytes over baseline stay flat from 2 to 8 layers with fast routing and grow with
    the plain path's stacking Router (which keeps O(S^2 * B*T*D))."""
    idx = idx_batch(B=2, T=32)

    def ratio(n_layer, residual, fast=True, heads=None):
        torch.manual_seed(0)
        model = GPT(tiny(residual, n_layer=n_layer, n_embd=128, fast_routing=fast, route_heads=heads))
        torch.manual_seed(0)
        return saved_bytes(model, idx) / saved_bytes(GPT(tiny(n_layer=n_layer, n_embd=128)), idx)

    for residual, heads in (("delta", 1), ("attnres", 1), ("delta", 4), ("delta_block", 4)):
        r2, r8 = ratio(2, residual, heads=heads), ratio(8, residual, heads=heads)
        assert r8 < 1.35 and r8 / r2 < 1.1, (residual, heads, r2, r8)
    assert ratio(8, "delta", fast=False) / ratio(2, "delta", fast=False) > 1.5


def test_bf16_autocast_keeps_no_float32_copies_of_sources():
    """Under bf16 autocast the sources are bf16; scoring them in float32 (Score) must not make autograd
    keep float32 copies, so the activation-memory ratio stays what it is in float32."""
    idx = idx_batch(B=2, T=32)

    def saved(residual):
        torch.manual_seed(0)
        model = GPT(tiny(residual, n_embd=128))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return saved_bytes(model, idx)

    # measured 1.07; float32 copies of the 9 sources would add about 0.10
    assert saved("delta") / saved("baseline") < 1.12


@pytest.mark.compile
def test_compiled_graph_saves_linear_memory():
    """Under torch.compile the fast path (traced by Dynamo, partitioned by AOTAutograd as Inductor does)
    still saves only references to the sources: the ratio to baseline stays flat with depth."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from functorch.compile import make_boxed_func
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=lambda gm, _: make_boxed_func(gm),
                           partition_fn=min_cut_rematerialization_partition)
    idx = idx_batch(B=2, T=32)

    def saved(residual, n_layer):
        torch.manual_seed(0)
        torch._dynamo.reset()
        return saved_bytes(torch.compile(GPT(tiny(residual, n_layer=n_layer, n_embd=128)), backend=backend), idx)

    r1, r4 = (saved("delta", L) / saved("baseline", L) for L in (1, 4))
    torch._dynamo.reset()
    assert r4 < 1.35 and r4 / r1 < 1.1, (r1, r4)  # the plain stacking path: 1.33, 2.09


# ---------------------------------------------------------------- recompute (activation checkpointing) changes no gradient

def recompute_(model, on=True):
    for block in model.transformer.h:
        block.recompute = on
    return model


@pytest.mark.parametrize("residual", ["baseline", "delta"])
def test_recompute_gives_identical_gradients_and_saves_less(residual):
    """Each sublayer's f(LN(u)) recomputed in backward (dropout on, so its random masks must repeat):
    the same loss and gradients, bit for bit, and fewer saved bytes."""
    model = model_of(tiny(residual, dropout=0.1), queries=1.0).train()
    idx = idx_batch()

    def run():
        torch.manual_seed(5)
        return logits_and_grads(model, idx)

    logits, grads = run()
    full = saved_bytes(model, idx)
    recompute_(model)
    logits_re, grads_re = run()
    torch.testing.assert_close(logits_re, logits, atol=0, rtol=0)
    for name in grads:
        torch.testing.assert_close(grads_re[name], grads[name], atol=0, rtol=0, msg=name)
    assert saved_bytes(model, idx) < 0.7 * full


@pytest.mark.compile
def test_compiled_recompute_gives_eager_gradients():
    model = model_of(tiny("delta", n_layer=2), queries=1.0)
    idx = idx_batch(T=16)
    eager_logits, eager_grads = logits_and_grads(model, idx)
    torch._dynamo.reset()
    logits, grads = logits_and_grads(torch.compile(recompute_(model), fullgraph=True), idx)
    torch._dynamo.reset()
    torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5)
    for name in eager_grads:
        torch.testing.assert_close(grads[name], eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


# ---------------------------------------------------------------- causality and the KV cache

@pytest.mark.parametrize("residual", RESIDUALS)
def test_causality(residual):
    model = model_of(tiny(residual), queries=1.0)
    idx = idx_batch(T=24)
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % VOCAB
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0, rtol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 5)])
def test_kv_cache_generation_equals_recompute(residual, temperature, top_k):
    model = model_of(tiny(residual, block_size=16), queries=1.0)
    prompt = idx_batch(B=2, T=5)
    out = {}
    for use_cache in (True, False):  # 30 new tokens: the window slides past block_size 16
        torch.manual_seed(123)
        out[use_cache] = model.generate(prompt, 30, temperature=temperature, top_k=top_k, use_cache=use_cache)
    assert out[True].shape == (2, 35)
    assert torch.equal(out[True], out[False])


@pytest.mark.parametrize("residual", RESIDUALS)
def test_cached_logits_equal_full_forward(residual):
    model = model_of(tiny(residual), queries=1.0)
    idx = idx_batch(T=20)
    full, _ = model(idx)
    cache = [[] for _ in model.transformer.h]
    with torch.no_grad():
        parts = [model.hidden(idx[:, :7], cache), model.hidden(idx[:, 7:12], cache)]
        parts += [model.hidden(idx[:, t:t + 1], cache) for t in range(12, 20)]
    torch.testing.assert_close(model.lm_head(torch.cat(parts, dim=1)), full, atol=1e-5, rtol=1e-5)


def test_generate_bad_arguments():
    model = model_of(tiny())
    prompt = idx_batch(T=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, 0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 2, top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1)


# ---------------------------------------------------------------- checkpoints and state_dict names

@pytest.mark.parametrize("name", ["delta", "attnres", "baseline"])
@pytest.mark.parametrize("fast", [True, False])
def test_checkpoints_of_the_previous_format_still_load(name, fast):
    """tests/data/old-format-*.pt were written by `cli.py train` before GPTConfig had fast_routing (attnres's
    with its final router), with the logits they gave then on a fixed input: they load, on either path, and
    give the same logits."""
    ckpt = CK.load_checkpoint(DATA / f"old-format-{name}.pt")
    assert "fast_routing" not in ckpt["model_config"] and "route_weights" not in ckpt["model_config"]
    model = CK.model_from_checkpoint(ckpt).eval()
    assert model.config.route_weights == (None if name == "baseline" else "dynamic")  # older checkpoints route dynamically
    assert model.config.route_heads == (None if name == "baseline" else 1)  # and with one head
    model.config.fast_routing = fast
    expected = torch.load(DATA / "old-format-logits.pt", weights_only=True)[name]
    with torch.no_grad():
        logits, _ = model(expected["idx"])
    torch.testing.assert_close(logits, expected["logits"])


def test_one_head_static_checkpoint_of_the_previous_shape_loads():
    """Static logits were (n,) for one head before they were (H, n) for every H: such a checkpoint loads, reshaped,
    and routes as it did."""
    model = model_of(tiny("attnres", route_weights="static", n_route_blocks=2), queries=1.0)
    old = {k: v.squeeze(0) if k.endswith("_router.logits") else v for k, v in model.state_dict().items()}
    assert any(v.dim() == 1 for k, v in old.items() if k.endswith("_router.logits"))
    ckpt = dict(model=old, model_config=dict(vars(model.config)))
    loaded = CK.model_from_checkpoint(ckpt).eval()
    assert all(r.logits.shape == (1, n) for r, n in zip(loaded.routers, loaded.sources_per_router()))
    with torch.no_grad():
        assert torch.equal(loaded(idx_batch())[0], model(idx_batch())[0])


def test_fast_routing_is_not_part_of_the_weights():
    fast, plain = GPT(tiny("attnres")), GPT(tiny("attnres", fast_routing=False))
    assert fast.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(fast.state_dict())


@pytest.mark.parametrize("residual", RESIDUALS)
def test_baseline_state_dict_loads_with_only_routing_keys_missing(residual):
    base = model_of(tiny())
    model = GPT(tiny(residual))
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert unexpected == []
    expected = set()
    if residual != "baseline":
        for i in range(4):
            for r in ("attn_router", "mlp_router"):
                expected |= {f"transformer.h.{i}.{r}.query", f"transformer.h.{i}.{r}.norm.weight"}
    if residual == "attnres":
        expected |= {"transformer.final_router.query", "transformer.final_router.norm.weight"}
    assert set(missing) == expected
    nano = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
            "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight", "transformer.h.0.ln_2.bias",
            "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.bias", "transformer.ln_f.weight",
            "lm_head.weight"}
    assert nano <= set(model.state_dict())


def test_from_hf_state_dict_maps_gpt2_names():
    base = model_of(tiny(vocab_size=VOCAB))
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    sd_hf = {k: (v.t() if k.endswith(transposed) else v) for k, v in base.state_dict().items()}
    sd_hf["transformer.h.0.attn.bias"] = torch.ones(1)  # HF's mask buffers are dropped
    model = GPT.from_hf_state_dict(sd_hf, tiny("delta"))
    for k, v in base.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if n.endswith("router.query"))


def test_from_pretrained_refuses_unknown_model():
    with pytest.raises(ValueError, match="unknown GPT-2 model 'gpt3'; choose one of gpt2, gpt2-medium"):
        GPT.from_pretrained("gpt3")


def test_from_pretrained_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ValueError, match="needs the transformers package: pip install transformers"):
        GPT.from_pretrained("gpt2")


# ---------------------------------------------------------------- optimizer groups, parameter and FLOP counts

def test_configure_optimizers_groups():
    model = GPT(tiny("delta"))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu", route_lr_mult=3.0)
    decay, nodecay, route = opt.param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in nodecay["params"]) and nodecay["weight_decay"] == 0.0
    assert route["weight_decay"] == 0.0 and route["lr"] == pytest.approx(3e-3) and route["lr_mult"] == 3.0
    assert {id(p) for p in route["params"]} == {id(p) for p in model.route_parameters()}
    assert len(route["params"]) == 16  # query and gain of 8 routers
    counted = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert counted == sum(p.numel() for p in model.parameters())  # tied weight once
    assert len(GPT(tiny()).configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu").param_groups) == 2


def test_routing_parameter_overhead_is_4D_per_layer():
    base, delta = GPT(tiny()), GPT(tiny("delta"))
    assert delta.get_num_params() - base.get_num_params() == 4 * 64 * 4


def test_estimate_mfu_is_none_on_cpu():
    model = GPT(tiny("delta"))
    assert model.estimate_mfu(fwdbwd_per_iter=8, dt=0.1) is None
    assert model.flops_per_token() > GPT(tiny()).flops_per_token()


# ---------------------------------------------------------------- bad config is one clear ValueError

@pytest.mark.parametrize("kw,match", [
    (dict(residual="resnet"), "residual='resnet' is unknown; choose one of baseline, attnres, delta, delta_block"),
    (dict(residual="attnres", n_route_blocks=3), "n_route_blocks=3 must divide 2\\*n_layer=8"),
    (dict(residual="delta_block", n_route_blocks=0), "n_route_blocks=0 must divide"),
    (dict(residual="delta_block", n_route_blocks=-2), "n_route_blocks=-2 must divide"),
    (dict(residual="delta", n_route_blocks=4), "residual='delta' routes per sublayer"),
    (dict(residual="baseline", route_sources="delta"), "route_sources is set but residual='baseline'"),
    (dict(residual="baseline", route_partial=True), "route_partial is set but residual='baseline'"),
    (dict(residual="baseline", n_route_blocks=2), "n_route_blocks is set but residual='baseline'"),
    (dict(residual="delta", route_sources="stream"), "route_sources='stream' is unknown"),
    (dict(residual="attnres", route_partial=False), "attnres always routes the current partial"),
    (dict(n_head=3), "n_embd=64 is not divisible by n_head=3"),
    (dict(residual="attnres", n_layer=3), "n_route_blocks=4 \\(the default for this mode\\) must divide 2\\*n_layer=6"),
    (dict(fast_routing="yes"), "fast_routing='yes' must be True or False"),
    (dict(residual="delta", route_weights="fixed"), "route_weights='fixed' is unknown; choose one of dynamic, static"),
    (dict(residual="baseline", route_weights="static"), "route_weights is set but residual='baseline' has no routing"),
    (dict(residual="baseline", route_heads=2), "route_heads is set but residual='baseline' has no routing"),
    (dict(residual="delta", route_heads=3), "route_heads=3 must be a whole number that divides n_embd=64; choose one of 1, 2, 4, 8, 16, 32, 64"),
    (dict(residual="delta", route_heads=0), "route_heads=0 must be a whole number that divides"),
    (dict(residual="delta", route_heads=2.0), "route_heads=2.0 must be a whole number"),
    (dict(residual="delta", route_heads=True), "route_heads=True must be a whole number"),
])
def test_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_idx_longer_than_block_size_raises():
    model = GPT(tiny(block_size=8))
    with pytest.raises(ValueError, match="Cannot forward sequence of length 9, block size is only 8"):
        model(idx_batch(T=9))
