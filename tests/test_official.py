"""Two conventions where the official code (wdlctc/delta-attention-residuals-code) differs from ours, pinned on
our side (docs/method.md, section 7): our `delta` routes the first sublayer too (over [e], so u_1 = 2e), and
our `delta_block` makes a finished block a source before the next block's first sublayer reads."""
import pytest
import torch
from torch.nn import functional as F

from delta_gpt import GPT, GPTConfig, ROUTE_EPS

VOCAB = 61
PATHS = [pytest.param(True, id="fast"), pytest.param(False, id="plain")]


def tiny_model(residual, fast, dtype=torch.float32, **kw):
    """4 layers (8 sublayers), width 64, context 64, eval mode; random non-zero queries and gains, so that
    routing weights are far from uniform."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=64, dropout=0.0,
                       residual=residual, fast_routing=fast, **kw)
    model = GPT(config).to(dtype).eval()
    with torch.no_grad():
        for router in model.routers:
            router.query.normal_(0, 1.0)
            router.norm.weight.uniform_(0.5, 1.5)
    return model


def idx_batch(B=2, T=32):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))


def embedding(model, idx):
    """e = token + position embedding, as the model computes it (dropout is off)."""
    return model.transformer.wte(idx) + model.transformer.wpe(torch.arange(idx.size(1)))


# ---------------------------------------------------------------- (a) delta routes the first sublayer over [e]

@pytest.mark.parametrize("fast", PATHS)
def test_delta_routes_the_first_sublayer_over_the_embedding(fast):
    """The official `delta` leaves sublayer 1 unrouted (u_1 = e). Ours routes it over the one source [e]:
    weight exactly 1, so u_1 = e + e = 2e, which is what the first attention's LayerNorm receives."""
    model = tiny_model("delta", fast)
    idx = idx_batch()
    ln_inputs = []
    hook = model.transformer.h[0].ln_1.register_forward_pre_hook(lambda mod, args: ln_inputs.append(args[0]))
    record = []
    with torch.no_grad():
        model.hidden(idx, record=record)
        e = embedding(model, idx)
    hook.remove()
    assert len(record) == model.config.n_sublayers  # every sublayer is routed, the first included
    sources, alpha = record[0]
    assert len(sources) == 1
    assert torch.equal(sources[0], e)
    assert alpha.shape == (*idx.shape, 1, 1) and torch.all(alpha == 1)  # (B, T, H, n)
    assert len(ln_inputs) == 1 and torch.equal(ln_inputs[0], 2 * e)
    assert len(record[1][0]) == 2  # sublayer 2 reads [e, v_1]


def test_layernorm_of_2e_is_layernorm_of_e_up_to_eps():
    """LN(2e) = LN(e) only up to LayerNorm's eps: exactly LN(e) with eps/4. With eps 0 they are equal; with
    eps they differ, by a per-token factor sqrt((var+eps)/(var+eps/4)) <= 1 + 3 eps / (8 var) on LN(e) - bias."""
    model = tiny_model("delta", True)  # GPT-2's init: embedding std 0.02, so var(e) is near eps
    ln = model.transformer.h[0].ln_1
    with torch.no_grad():
        e = embedding(model, idx_batch()).double()
        w, b = ln.weight.double() + 0.1 * torch.randn(e.size(-1), dtype=torch.float64), ln.bias.double() + 0.1
    eps = ln.eps
    assert eps == 1e-5

    def LN(x, eps):
        return F.layer_norm(x, x.shape[-1:], w, b, eps)

    torch.testing.assert_close(LN(2 * e, 0.0), LN(e, 0.0), rtol=1e-12, atol=1e-12)      # scale invariance
    torch.testing.assert_close(LN(2 * e, eps), LN(e, eps / 4), rtol=1e-12, atol=1e-12)  # eps weighs a quarter
    diff = (LN(2 * e, eps) - LN(e, eps)).abs()
    assert diff.max() > 1e-4  # at GPT-2's init eps is visible: not equal
    var = e.var(dim=-1, unbiased=False, keepdim=True)
    assert torch.all(diff <= 3 * eps / (8 * var) * (LN(e, eps) - b).abs() + 1e-12)  # but close


# ---------------------------------------------------------------- (b) delta_block: a finished block is read at once

def run_by_hand(model, idx, late=False):
    """delta_block (no partial) in float64, sublayer by sublayer: u_k = x_{k-1} + read(sources), the sources
    [e, b_1, ..., b_m] with b_j = (stream at block j's end) - (stream at its start). late=True is the official
    ordering: a block (e too) joins the sources only after the next sublayer has read them.
    Returns each sublayer's (sources, alpha), the stream states x_0..x_S and ln_f(x_S)."""
    L = model.config.n_sublayers // model.config.n_route_blocks
    sublayers = [(f, ln, router) for blk in model.transformer.h
                 for f, ln, router in ((blk.attn, blk.ln_1, blk.attn_router), (blk.mlp, blk.ln_2, blk.mlp_router))]
    x = embedding(model, idx)
    xs, blocks, pending, reads = [x], [], x, []  # pending: a finished block not yet a source (first e)
    for k, (f, ln, router) in enumerate(sublayers, start=1):
        if not late and pending is not None:
            blocks, pending = blocks + [pending], None
        sources = list(blocks)
        u, alpha = x, None
        if sources:
            s = torch.stack(sources, dim=-2)  # (B, T, n, D)
            keys = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + ROUTE_EPS) * router.norm.weight
            alpha = (keys @ router.query).softmax(dim=-1)  # (B, T, n)
            u = x + (alpha.unsqueeze(-1) * s).sum(dim=-2)
        reads.append((sources, alpha))
        if late and pending is not None:
            blocks, pending = blocks + [pending], None
        x = x + f(ln(u))
        xs.append(x)
        if k % L == 0:
            pending = x - xs[k - L]
    return reads, xs, model.transformer.ln_f(x)


@pytest.mark.parametrize("fast", PATHS)
def test_delta_block_start_reads_the_block_just_completed(fast):
    """8 sublayers in N=4 blocks of 2. The first sublayer of block j+1 reads [e, b_1, ..., b_j], b_j (the block
    just completed) included, where the official code reads it only from the next sublayer on; each b_j is
    the stream at block end minus the stream at block start. Checked against a float64 run by hand."""
    model = tiny_model("delta_block", fast, dtype=torch.float64, n_route_blocks=4)
    S, N = model.config.n_sublayers, model.config.n_route_blocks
    L = S // N
    assert model.config.route_partial is False
    idx = idx_batch()
    record = []
    with torch.no_grad():
        out = model.hidden(idx, record=record)
        ours, xs, out_by_hand = run_by_hand(model, idx)
        late, _, _ = run_by_hand(model, idx, late=True)
    close = dict(rtol=1e-10, atol=1e-12)  # float64 rounding
    assert len(record) == S
    for k, ((sources, alpha), (hand_sources, hand_alpha)) in enumerate(zip(record, ours), start=1):
        m = (k - 1) // L  # completed blocks
        assert len(sources) == len(hand_sources) == 1 + m
        torch.testing.assert_close(sources[0], xs[0], **close)  # b_0 = e
        for j in range(1, m + 1):  # b_j = x at block j's end - x at its start
            torch.testing.assert_close(sources[j], xs[j * L] - xs[(j - 1) * L], **close)
        torch.testing.assert_close(sum(sources), xs[m * L], **close)  # they sum to the block-start stream
        torch.testing.assert_close(alpha[..., 0, :], hand_alpha, **close)  # one head
    torch.testing.assert_close(out, out_by_hand, **close)
    for j in range(N):  # the official ordering reads one source fewer at every block start, and only there
        k = j * L + 1
        assert len(late[k - 1][0]) == j and len(record[k - 1][0]) == j + 1
        assert all(len(late[i][0]) == len(record[i][0]) for i in range(k, k + L - 1))
