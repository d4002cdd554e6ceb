"""The checks of the exercises in this folder (exercises/test_checks.py runs them under pytest). Each imports
a student's file afresh, runs its functions on small fixed float64 inputs and compares them with the
project's own code (delta_gpt's Router, Stream and GPT). A failure is one sentence (Wrong) saying what is
wrong in the exercise's terms; where the output is what a known mistake gives on the same inputs, it names
that mistake."""
import importlib.util
import math
import traceback
from copy import deepcopy
from dataclasses import asdict, replace
from pathlib import Path

import torch

from delta_gpt import GPT, GPTConfig, LayerNorm, Router, Stream

FOLDER = Path(__file__).resolve().parent
TOL = dict(rtol=1e-9, atol=1e-12)  # float64: the same sums in another order differ by about 1e-16
F64 = torch.float64


class Wrong(Exception):
    """A check's verdict: one sentence."""


class Unusable(Wrong):
    """The file cannot be run: it does not import, or a function is unwritten, raises, or returns the wrong
    type, shape, dtype or NaN (exercises.train_mine refuses to train with it)."""


class Student:
    """A student's functions, each error of a call turned into one sentence naming the file and function."""

    def __init__(self, module, file):
        self.module, self.file = module, file

    def __call__(self, name, *args, **kw):
        fn = getattr(self.module, name, None)
        if not callable(fn):
            raise Unusable(f"{self.file} has no function {name}(); keep the name and arguments the stub had.")
        try:
            return fn(*args, **kw)
        except NotImplementedError:
            raise Unusable(f"{self.file}: {name}() is not written yet (it raises NotImplementedError); "
                           f"write it as its docstring says.") from None
        except Exception as e:
            at = line_in(e, getattr(self.module, "__file__", None))
            fix = " (change parameters inside `with torch.no_grad():`)" if "leaf Variable" in str(e) else ""
            raise Unusable(f"{self.file}: {name}() raised {type(e).__name__}{at}: "
                           f"{first_sentence(e)}{fix}.") from None


def line_in(e, path):
    """' at line N': where in the student's file the exception e was raised, or '' if not there."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
    return f" at line {frames[-1].lineno}" if frames else ""


def first_sentence(text):
    """The first sentence of an error's text, without its full stop: a message stays one sentence."""
    return (str(text).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")


def load(name, folder=FOLDER):
    """The student's file folder/NAME.py, imported afresh (an edit counts at once); an import error is one
    sentence."""
    path, file = folder / f"{name}.py", f"{folder.name}/{name}.py"
    if not path.exists():
        raise Unusable(f"{file} is missing; `git checkout {file}` brings the stub back.")
    spec = importlib.util.spec_from_file_location(f"student_{name}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise Unusable(f"{file} does not import: {type(e).__name__} at line {e.lineno} "
                       f"({first_sentence(e.msg)}).") from None
    except Exception as e:
        raise Unusable(f"{file} does not import: {type(e).__name__}{line_in(e, path)}: "
                       f"{first_sentence(e)}.") from None
    return Student(module, file)


def returned(student, fn, what, t, shape, case):
    """t as fn() must return it: a float64 tensor of the given shape, every entry finite."""
    where = f"{student.file}: {fn}() returned {what}"
    if not isinstance(t, torch.Tensor):
        raise Unusable(f"{where} as {type(t).__name__} {case}; it must be a tensor of shape {tuple(shape)}.")
    if tuple(t.shape) != tuple(shape):
        raise Unusable(f"{where} of shape {tuple(t.shape)} {case}; it must be {tuple(shape)}.")
    if t.dtype != F64:
        raise Unusable(f"{where} in {t.dtype} {case}, whose inputs are float64; compute in the inputs' "
                       f"dtype.")
    if not torch.isfinite(t).all():
        raise Unusable(f"{where} with NaN or inf in it {case}.")
    return t


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def same(xs, ys):
    return len(xs) == len(ys) and all(close(x, y) for x, y in zip(xs, ys))


def verdict(student, fn, case, names, got, want, mistakes, reference):
    """Nothing if got equals want; else one sentence naming the wrong outputs and, if got is what one of the
    mistakes [(hint, output)] gives, that mistake."""
    bad = [n for n, a, b in zip(names, got, want) if not close(a, b)]
    if not bad:
        return
    wrong = f"{student.file}: {fn}() gives the wrong {and_list(bad)} {case}"
    for hint, out in mistakes:
        if same(got, out):
            raise Wrong(f"{wrong}: {hint}.")
    diff = max((a - b).abs().max().item() for a, b in zip(got, want))
    raise Wrong(f"{wrong} (at most {diff:.1e} away from {reference}'s); compare each step with the formula "
                f"in the file's docstring.")


def and_list(names):
    return f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]


# ---------------------------------------------------------------- A and B: the router's read, one head and H

def route_inputs(n, tiny=False, B=2, T=3, D=8):
    """n sources of growing scale (with tiny, one of scale 1e-4, where the norm's eps matters), a query w and
    a gain g."""
    gen = torch.Generator().manual_seed(n + 10 * tiny)
    sources = [torch.randn(B, T, D, generator=gen, dtype=F64) * (i + 1) for i in range(n)]
    if tiny:
        sources[1] = sources[1] * 1e-4
    return sources, torch.randn(D, generator=gen, dtype=F64), 0.5 + torch.rand(D, generator=gen, dtype=F64)


def project_route(sources, w, g, heads=1):
    """The project's Router with query w and gain g: read (B, T, D), alpha (B, T, H, n)."""
    router = Router(w.numel(), heads).to(F64)
    with torch.no_grad():
        router.query.copy_(w)
        router.norm.weight.copy_(g)
        read, alpha = router(sources)
    return read, alpha


def route_of(sources, w, g, heads=1, eps=1e-6, axis=-1, norm="rms", gain=True, scale=False, shared=False,
             strided=False, read_keys=False):
    """The router written out, with the one mistake a keyword asks for: read (B, T, D), alpha (B, T, H, n)."""
    s = torch.stack(sources, dim=-2)                                          # (B, T, n, D)
    D = s.size(-1)
    order = torch.arange(D).view(-1, heads).t().flatten() if strided else torch.arange(D)  # h: h, h+H, ...
    s, w, g = s[..., order], w[order], g[order]
    if norm == "per_head":
        s_h = s.unflatten(-1, (heads, -1))
        keys = (s_h / (s_h.square().mean(-1, keepdim=True) + eps).sqrt()).flatten(-2)
    elif norm == "none":
        keys = s
    else:
        c = s - s.mean(-1, keepdim=True) if norm == "layer" else s
        ms = c.square().mean(-1, keepdim=True)
        keys = c / (ms.sqrt() + eps) if norm == "eps_outside" else c / (ms + eps * (norm != "no_eps")).sqrt()
    keys = keys * g if gain else keys
    scores = (keys * w).unflatten(-1, (heads, -1)).sum(-1)                   # (B, T, n, H)
    scores = scores.sum(-1, keepdim=True).expand_as(scores) if shared else scores
    scores = scores / math.sqrt(D // heads) if scale else scores
    alpha = scores.transpose(-1, -2).softmax(dim=axis)                        # (B, T, H, n)
    values = (keys if read_keys else s).unflatten(-1, (heads, -1))            # (B, T, n, H, D/H)
    read = (alpha.transpose(-1, -2).unsqueeze(-1) * values).sum(-3).flatten(-2)
    return read[..., order.argsort()], alpha


NORM_MISTAKES = [  # (route_of's keywords, the hint that names the mistake)
    (dict(gain=False), "the gain g is forgotten: the key is g * s_i / sqrt(mean(s_i^2) + eps)"),
    (dict(norm="none"), "the keys are not RMS-normed: divide each s_i by sqrt(mean(s_i^2) + eps) over its D "
                        "channels"),
    (dict(norm="layer"), "the mean is subtracted (a LayerNorm): RMSNorm only divides by the root mean "
                         "square"),
    (dict(norm="no_eps"), "eps is missing: sqrt(mean(s_i^2) + eps), which matters most for a small source"),
    (dict(norm="eps_outside"), "eps is added outside the square root: sqrt(mean(s_i^2) + eps)"),
    (dict(read_keys=True), "the read mixes the normed keys: it is sum_i alpha_i * s_i, the sources "
                           "themselves"),
]
AXIS = "softmax over the wrong axis: alpha must sum to one over the n sources (alpha's last axis)"
ROUTE_MISTAKES = NORM_MISTAKES + [
    (dict(axis=0), AXIS + ", for each token"), (dict(axis=1), AXIS + ", for each token"),
    (dict(scale=True), "the scores are divided by sqrt(D): the router has no 1/sqrt(D) and no temperature"),
]
HEAD_MISTAKES = NORM_MISTAKES + [
    (dict(norm="per_head"), "the RMSNorm is taken per head: norm each source over its full width D, then cut "
                            "the keys into heads"),
    (dict(axis=-2), AXIS + ", for each token and head, not over the heads"),
    (dict(axis=1), AXIS + ", for each token and head"), (dict(axis=0), AXIS + ", for each token and head"),
    (dict(strided=True), "the heads take strided channels: head h owns the contiguous channels h*D/H to "
                         "(h+1)*D/H - 1 (unflatten the last dim to (H, D/H))"),
    (dict(shared=True), "every head uses the one-head score: head h's score is w_h . key_i[h], its own part "
                        "of it"),
    (dict(scale=True), "the scores are divided by sqrt(D/H): the router has no temperature"),
]


def read_and_alpha(student, fn, out, case, shapes):
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise Unusable(f"{student.file}: {fn}() returned {type(out).__name__} {case}; it must return "
                       f"(read, alpha).")
    return tuple(returned(student, fn, what, t, shape, case)
                 for what, t, shape in zip(("read", "alpha"), out, shapes))


def router_read(student):
    """route() against the project's Router (one head): 3 sources, one source, a source of scale 1e-4."""
    for case, n, tiny in [("for 3 sources", 3, False), ("for one source", 1, False),
                          ("for 3 sources, one of scale 1e-4", 3, True)]:
        sources, w, g = route_inputs(n, tiny)
        out = student("route", [s.clone() for s in sources], w.clone(), g.clone())
        got = read_and_alpha(student, "route", out, case, (sources[0].shape, sources[0].shape[:2] + (n,)))
        one_head = lambda out: (out[0], out[1].squeeze(-2))
        mistakes = [(hint, one_head(route_of(sources, w, g, **kw))) for kw, hint in ROUTE_MISTAKES]
        verdict(student, "route", case, ("read", "alpha"), got, one_head(project_route(sources, w, g)),
                mistakes, "the project's Router")


def multi_head(student):
    """route_heads() against the project's multi-head Router: 2 heads, one source, 8 heads of one channel
    with a source of scale 1e-4, and one head."""
    for case, n, heads, tiny in [("for 3 sources and 2 heads", 3, 2, False),
                                 ("for one source and 4 heads", 1, 4, False),
                                 ("for 3 sources, one of scale 1e-4, and 8 heads of one channel", 3, 8, True),
                                 ("for 3 sources and one head", 3, 1, False)]:
        sources, w, g = route_inputs(n, tiny)
        out = student("route_heads", [s.clone() for s in sources], w.clone(), g.clone(), heads)
        shapes = (sources[0].shape, sources[0].shape[:2] + (heads, n))
        got = read_and_alpha(student, "route_heads", out, case, shapes)
        mistakes = [(hint, route_of(sources, w, g, heads, **kw)) for kw, hint in HEAD_MISTAKES]
        verdict(student, "route_heads", case, ("read", "alpha"), got, project_route(sources, w, g, heads),
                mistakes, "the project's Router")


# ---------------------------------------------------------------- C: the sources of a mode

MODES = [  # (residual, routing options, the name a message gives it)
    ("delta", {}, "delta (per sublayer)"),
    ("attnres", dict(n_route_blocks=4), "attnres with 4 blocks"),
    ("attnres", dict(n_route_blocks=2), "attnres with 2 blocks"),
    ("delta_block", dict(n_route_blocks=4), "delta_block with 4 blocks"),
    ("delta_block", dict(n_route_blocks=2, route_partial=True), "delta_block with 2 blocks (route_partial)"),
    ("delta_block", dict(n_route_blocks=1), "delta_block with 1 block"),  # reads only e: one source
]


def pieces(S=8, B=2, T=3, D=8):
    """e and the sublayer outputs v_1..v_S (v_3 of scale 1e-4), float64."""
    gen = torch.Generator().manual_seed(0)
    e, *vs = [torch.randn(B, T, D, generator=gen, dtype=F64) for _ in range(S + 1)]
    vs[2] = vs[2] * 1e-4
    return e, vs


def mode_config(residual, kw):
    return GPTConfig(n_layer=4, n_head=1, n_embd=8, vocab_size=11, block_size=8, residual=residual, **kw)


def project_reads(config, e, vs):
    """The sources the project's Stream gives before each sublayer k = 1..S, and for attnres after the last
    (its final router's read)."""
    stream, reads = Stream(e, config), []
    for v in vs:
        reads.append(stream.sources())
        stream.write(v)
    return reads + ([stream.sources()] if config.residual == "attnres" else [])


def reads_of(write, sources, e, vs, block_len, route_partial, final):
    """The same reads from a write() and a sources() of the exercise's form (copies: a later in-place edit
    does not change them)."""
    blocks, partial, reads = [e], None, []
    for k, v in enumerate(vs, start=1):
        reads.append([s.clone() for s in sources(blocks, partial, route_partial)])
        blocks, partial = write(blocks, partial, v.clone(), k, block_len)
    return reads + ([[s.clone() for s in sources(blocks, partial, route_partial)]] if final else [])


def student_reads(student, e, vs, block_len, route_partial, final, mode):
    """reads_of with the student's write() and sources(), each return checked before it is used."""
    k = [1]  # the sublayer whose sources are read next

    def write(blocks, partial, v, at, L):
        out = student("write", blocks, partial, v, at, L)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], (list, tuple))
                and (out[1] is None or isinstance(out[1], torch.Tensor))):
            raise Unusable(f"{student.file}: write() returned {type(out).__name__} after sublayer {at} of "
                           f"{mode}; it must return (blocks, partial): a list of tensors, a tensor or None.")
        k[0] = at + 1
        return list(out[0]), out[1]

    def sources(blocks, partial, route_partial):
        out, case = student("sources", blocks, partial, route_partial), f"{when(k[0], len(vs))} of {mode}"
        if not isinstance(out, (list, tuple)):
            raise Unusable(f"{student.file}: sources() returned {type(out).__name__} {case}; it must return "
                           f"a list.")
        return [returned(student, "sources", "a source", s, e.shape, case) for s in out]

    return reads_of(write, sources, e, vs, block_len, route_partial, final)


def when(k, S):
    return f"before sublayer {k}" if k <= S else "after the last sublayer (attnres's final router)"


def combination(t, e, vs):
    """t's integer coefficients on [e, v_1, ..., v_S], or None when t is no such combination."""
    basis = torch.stack([e, *vs]).flatten(1).t()
    c = torch.linalg.lstsq(basis, t.flatten()[:, None]).solution[:, 0].round()
    return c if torch.allclose(basis @ c, t.flatten(), **TOL) else None


def describe(c):
    """Coefficients on [e, v_1, ...] as text, 'e + v1+..+v4 + 2 v5': a run of v's at 1 shortened."""
    if c is None:
        return "?"
    terms, j = [("e", int(c[0]))] if c[0] else [], 1
    while j < len(c):
        end = j
        while c[j] == 1 and end + 1 < len(c) and c[end + 1] == 1:
            end += 1
        if c[j]:
            name = f"v{j}" if end == j else f"v{j}+v{end}" if end == j + 1 else f"v{j}+..+v{end}"
            terms.append((name, int(c[j])))
        j = end + 1
    text = " + ".join(name if n == 1 else f"-{name}" if n == -1 else f"{n} {name}" for name, n in terms)
    return text.replace("+ -", "- ") or "0"


def listed(ts, e, vs):
    return "[" + ", ".join(describe(combination(t, e, vs)) for t in ts) + "]"


def one_off(got, want):
    """(i, 'missing') or (i, 'counted twice') where got is want less its source i or with it twice."""
    for i, t in enumerate(want):
        if same(got, want[:i] + want[i + 1:]):
            return i, "missing"
        if same(got, want[:i + 1] + [t] + want[i + 1:]):
            return i, "counted twice"
    return None


def official_write(blocks, partial, v, k, L):
    """The official code's bookkeeping: its partial is the stream x (e included, never reset) and a completed
    block appends x - blocks[-1], so the blocks are [e, b1, e+b2, b1+b3, ...]."""
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


def right_write(blocks, partial, v, k, L):
    partial = v if partial is None else partial + v
    return (blocks + [partial], None) if k % L == 0 else (blocks, partial)


def right_sources(blocks, partial, route_partial):
    return blocks + [partial] if route_partial and partial is not None else list(blocks)


SOURCE_MISTAKES = [  # (write, sources, hint)
    (official_write, right_sources, "this is the official code's bookkeeping, its partial the stream x "
                                    "(e included, never reset) and a new block x - blocks[-1]; a block's "
                                    "source is the sum of its own sublayers' outputs, and the partial the "
                                    "current block's"),
    (minus_last_write, right_sources, "a block's source is its partial sum itself, not partial - blocks[-1] "
                                      "(the official code's bookkeeping, whose partial is the stream)"),
    (not_reset_write, right_sources, "the partial sum is not reset when its block completes (set it back to "
                                     "None), so each block also carries the earlier blocks' outputs"),
    (last_only_write, right_sources, "each block keeps only its last sublayer's output; add v to the partial "
                                     "sum"),
    (right_write, lambda b, p, rp: b + [p] if p is not None else list(b),
     "route_partial is False here, so the partial sum is no source: only e and the completed blocks are"),
    (right_write, lambda b, p, rp: list(b), "the current block's partial sum is missing: with route_partial "
                                            "(attnres always) it is read while its block is not empty"),
]


def sources_match_stream(student):
    """write() and sources() give the project's Stream's sources, in order, before every sublayer of each
    mode (and for attnres after the last)."""
    e, vs = pieces()
    for residual, kw, mode in MODES:
        config = mode_config(residual, kw)
        L, S, final = config.n_sublayers // config.n_route_blocks, config.n_sublayers, residual == "attnres"
        want = project_reads(config, e, vs)
        got = student_reads(student, e, vs, L, config.route_partial, final, mode)
        for k, (a, b) in enumerate(zip(got, want), start=1):
            if same(a, b):
                continue
            wrong = (f"{student.file}: write() and sources() give {mode} the sources {listed(a, e, vs)} "
                     f"{when(k, S)}, where the project's Stream reads {listed(b, e, vs)}")
            for write, sources, hint in SOURCE_MISTAKES:
                if same(a, reads_of(write, sources, e, vs, L, config.route_partial, final)[k - 1]):
                    raise Wrong(f"{wrong}: {hint}.")
            off = one_off(a, b)
            if off:
                raise Wrong(f"{wrong}: {describe(combination(b[off[0]], e, vs))} is {off[1]}.")
            raise Wrong(f"{wrong}.")


def sources_telescope(student):
    """The sources sum to the stream x_{k-1} = e + v_1 + ... + v_{k-1} in attnres, delta and delta_block with
    route_partial; plain delta_block's to the stream where the current block began."""
    e, vs = pieces()
    for residual, kw, mode in MODES:
        config = mode_config(residual, kw)
        L, S = config.n_sublayers // config.n_route_blocks, config.n_sublayers
        got = student_reads(student, e, vs, L, config.route_partial, residual == "attnres", mode)
        for k, read in enumerate(got, start=1):
            done = k - 1 if config.route_partial else (k - 1) // L * L  # how many v's the sum must hold
            total = sum(read, torch.zeros_like(e))
            if close(total, e + sum(vs[:done], torch.zeros_like(e))):
                continue
            want = torch.tensor([1.0] * (1 + done) + [0.0] * (S - done), dtype=F64)
            have = combination(total, e, vs)
            wrong = (f"{student.file}: write() and sources() give {mode} sources {when(k, S)} that sum to "
                     f"{describe(have)}, not to x_{done} = {describe(want)}"
                     + ("" if config.route_partial else ", the stream where the current block began"))
            if have is None:
                raise Wrong(f"{wrong}.")
            names = ["e"] + [f"v{j}" for j in range(1, S + 1)]
            kinds = [(lambda h, w: h > w > 0, "counted twice"), (lambda h, w: h < w, "missing"),
                     (lambda h, w: h > w == 0, "read before its block is complete")]
            said = [f"{', '.join(names[i] for i in range(S + 1) if test(have[i], want[i]))} {how}"
                    for test, how in kinds if any(test(have[i], want[i]) for i in range(S + 1))]
            raise Wrong(f"{wrong}: {' and '.join(said)}.")


# ---------------------------------------------------------------- D: the zero-init identity

def random_router(heads, D=8):
    torch.manual_seed(0)
    router = Router(D, heads)
    with torch.no_grad():
        router.query.normal_()  # the official code's init (PyTorch's default normal): routing not uniform
        router.norm.weight.uniform_(0.5, 1.5)
    return router


def zero_init_router(student):
    """init_router_() sets a router's query and gain to what GPT's own init gives them."""
    ref = GPT(mode_config("delta", {})).routers[0]  # as GPT._init_weights leaves a router
    for heads in (1, 2):
        router = random_router(heads)
        student("init_router_", router)
        w, g = router.query, router.norm.weight
        where = f"{student.file}: init_router_() leaves"
        if not torch.equal(w, ref.query):
            raise Wrong(f"{where} the query w not zero ({w.abs().max().item():.2g} at most): at init every "
                        f"score w . key_i must be 0, so that alpha_i = 1/n and the read is a multiple of the "
                        f"stream.")
        if torch.equal(g, torch.zeros_like(g)):
            raise Wrong(f"{where} the gain g at zero: then w's gradient, the key g * RMSNorm(s_i), is zero "
                        f"too and routing never learns; start g at one, as RMSNorm does.")
        if not torch.equal(g, ref.norm.weight):
            lo, hi = g.min().item(), g.max().item()
            raise Wrong(f"{where} the gain g at {lo:.2g}{f' to {hi:.2g}' if hi > lo else ''}, not one; start "
                        f"it at one, as RMSNorm (and GPT._init_weights) does.")


def unit_gain_baseline():
    """A tiny baseline whose stream's variance is far above LayerNorm's eps (test_model.py's unit_gain_)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 1.0 if "wte" in name or "wpe" in name else 1 / math.sqrt(p.size(1)) if p.dim() == 2 else 0.1
            p.normal_(0, std)
    return model


def exact(model):
    """The model in float64 with LayerNorm's eps 0: LN(c x) = LN(x) for every c > 0, the identity exact."""
    model = deepcopy(model).to(F64).eval()
    for m in model.modules():
        if isinstance(m, LayerNorm):
            m.eps = 0.0
    return model


CONVERSIONS = [  # modes whose sources telescope, so that the identity holds
    ("delta", {}), ("attnres", dict(n_route_blocks=2, route_heads=2)),
    ("delta_block", dict(n_route_blocks=2, route_partial=True)), ("attnres", dict(n_route_blocks=1)),
]


def zero_init_convert(student):
    """convert() gives a routed model with the baseline's weights, zero queries, and the baseline's logits
    (float64, LayerNorm eps 0)."""
    base = unit_gain_baseline()
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = exact(base)(idx)[0]
    for residual, kw in CONVERSIONS:
        args = ", ".join(["baseline", residual] + [f"{k}={v}" for k, v in kw.items()])
        where = f"{student.file}: convert({args})"
        model = student("convert", deepcopy(base), residual, **kw)
        if not isinstance(model, GPT):
            raise Unusable(f"{where} returned {type(model).__name__}; it must return a delta_gpt.GPT.")
        asked = asdict(replace(base.config, residual=residual, **kw))
        changed = [k for k, v in asdict(model.config).items() if asked.get(k) != v]
        if changed:
            raise Wrong(f"{where} built {changed[0]}={getattr(model.config, changed[0])!r} where "
                        f"{changed[0]}={asked[changed[0]]!r} was asked; build GPT(replace(baseline.config, "
                        f"residual=residual, **routing)).")
        sd, base_sd = model.state_dict(), base.state_dict()
        lost = [k for k in base_sd if k not in sd or not torch.equal(sd[k].to(base_sd[k].dtype), base_sd[k])]
        if lost:
            raise Wrong(f"{where} does not hold the baseline's {lost[0]}: load the baseline's state_dict "
                        f"into the routed model (strict=False: the routers' keys are the ones it lacks).")
        if any(not torch.equal(r.query, torch.zeros_like(r.query)) for r in model.routers):
            raise Wrong(f"{where} has a query w that is not zero at init, so the routing is not uniform and "
                        f"the read is no multiple of the stream; init every router with init_router_().")
        out = exact(model)(idx)[0]
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        if not err < 1e-12:
            raise Wrong(f"{where} does not compute the baseline's function: its logits are {err:.1e} "
                        f"(relative) away from the baseline's in float64 with LayerNorm eps 0.")


# ---------------------------------------------------------------- E: the router's backward

def project_backward(sources, w, g, grad_read):
    """Autograd through the project's Router: (dL/ds_i list, dL/dw, dL/dg)."""
    router = Router(w.numel()).to(F64)
    with torch.no_grad():
        router.query.copy_(w)
        router.norm.weight.copy_(g)
    sources = [s.clone().requires_grad_() for s in sources]
    grads = torch.autograd.grad(router(sources)[0], [*sources, router.query, router.norm.weight], grad_read)
    return list(grads[:-2]), grads[-2], grads[-1]


def backward_of(sources, w, g, G, eps=1e-6, softmax_sum=True, rms_grad=True, per_D=True, direct=True,
                routed=True, w_gain=True, g_query=True):
    """The router's backward written out, with the one mistake a keyword asks for: (dL/ds_i list, dL/dw,
    dL/dg)."""
    s = torch.stack(sources, dim=-2)                                   # (B, T, n, D)
    r = (s.square().mean(-1, keepdim=True) + eps).rsqrt()              # 1 / rms(s_i)
    keys = g * s * r
    logits = keys @ w
    alpha = logits.softmax(-1)
    grad_alpha = (s * G.unsqueeze(-2)).sum(-1)                         # G . s_i
    grad_logits = alpha * (grad_alpha - (alpha * grad_alpha).sum(-1, keepdim=True) * softmax_sum)
    dlogit_ds = w * g * r - (logits.unsqueeze(-1) * r.square() * s / (s.size(-1) if per_D else 1)) * rms_grad
    grad_s = alpha.unsqueeze(-1) * G.unsqueeze(-2) * direct + grad_logits.unsqueeze(-1) * dlogit_ds * routed
    grad_w = (grad_logits.unsqueeze(-1) * (keys if w_gain else s * r)).sum((0, 1, 2))
    grad_g = (grad_logits.unsqueeze(-1) * (w if g_query else 1) * s * r).sum((0, 1, 2))
    return list(grad_s.unbind(-2)), grad_w, grad_g


BACKWARD_MISTAKES = [
    (dict(softmax_sum=False), "the softmax's backward misses its second term: dL/dlogit_i = alpha_i "
                              "(dL/dalpha_i - sum_j alpha_j dL/dalpha_j)"),
    (dict(rms_grad=False), "r_i = 1/rms(s_i) is treated as a constant: it depends on s_i too, dr_i/ds_i = "
                           "-r_i^3 s_i / D"),
    (dict(per_D=False), "the 1/D of the mean is missing: dr_i/ds_i = -r_i^3 s_i / D"),
    (dict(direct=False), "the direct path is missing: read = sum_i alpha_i s_i gives s_i the gradient "
                         "alpha_i * grad_read besides the one through its score"),
    (dict(routed=False), "the path through the scores is missing: s_i also moves its own score w . key_i"),
    (dict(w_gain=False), "dL/dw forgets the gain: d logit_i / dw = key_i = g * s_i * r_i"),
    (dict(g_query=False), "dL/dg forgets the query: d logit_i / dg = w * s_i * r_i"),
]


def router_backward(student):
    """route_backward() against autograd through the project's Router, float64: 3 sources, one source, a
    source of scale 1e-4."""
    for case, n, tiny in [("for 3 sources", 3, False), ("for one source", 1, False),
                          ("for 3 sources, one of scale 1e-4", 3, True)]:
        sources, w, g = route_inputs(n, tiny)
        G = torch.randn(sources[0].shape, generator=torch.Generator().manual_seed(7), dtype=F64)
        out = student("route_backward", [s.clone() for s in sources], w.clone(), g.clone(), G.clone())
        if not (isinstance(out, (tuple, list)) and len(out) == 3 and isinstance(out[0], (list, tuple))
                and len(out[0]) == n):
            raise Unusable(f"{student.file}: route_backward() returned {type(out).__name__} {case}; it must "
                           f"return (grad_sources, a list of {n} tensors, grad_w, grad_g).")
        grad_s = [returned(student, "route_backward", "a source's gradient", t, G.shape, case)
                  for t in out[0]]
        got = (torch.stack(grad_s), returned(student, "route_backward", "grad_w", out[1], w.shape, case),
               returned(student, "route_backward", "grad_g", out[2], w.shape, case))
        stacked = lambda o: (torch.stack(o[0]), o[1], o[2])
        mistakes = [(hint, stacked(backward_of(sources, w, g, G, **kw))) for kw, hint in BACKWARD_MISTAKES]
        verdict(student, "route_backward", case, ("grad_sources", "grad_w", "grad_g"), got,
                stacked(project_backward(sources, w, g, G)), mistakes, "autograd")


CHECKS = {  # each exercise's file and its checks, in the page's order
    "router_read": [router_read],
    "multi_head": [multi_head],
    "sources": [sources_match_stream, sources_telescope],
    "zero_init": [zero_init_router, zero_init_convert],
    "router_backward": [router_backward],
}
