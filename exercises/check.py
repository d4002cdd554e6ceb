"""The checks of the exercises in this folder (exercises/conftest.py runs them under pytest, one
test per check). Each imports a student's file afresh, runs its functions on small fixed float64
inputs and compares them with the project's own code (delta_gpt's Router, Stream and GPT): the
values, then for the router the gradients that reach its inputs, then invariants of the formula on
random inputs. A failure is one sentence (Wrong) saying what is wrong in the exercise's terms; where
the output is what a known mistake (exercises/mistakes.py) gives on the same inputs, it names that
mistake."""
import importlib.util
import math
import re
import traceback
from copy import deepcopy
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from delta_gpt import GPT, GPTConfig, LayerNorm, Router, Stream
from exercises import mistakes as M

FOLDER = Path(__file__).resolve().parent
TOL = dict(rtol=1e-9, atol=1e-12)  # float64: the same sums in another order differ by about 1e-16
F64 = torch.float64


class Wrong(Exception):
    """A check's verdict: one sentence."""


class Unusable(Wrong):
    """The file cannot be run: it does not import, or a function is unwritten, raises, or returns
    the wrong type, shape, dtype or NaN (exercises.train_mine refuses to train with it)."""


class Blocked(Unusable):
    """A router no gradient flows through, or one that changes tensors in place: it cannot learn
    (exercises.train_mine refuses to train with it)."""


class Student:
    """A student's functions, each error of a call turned into one sentence naming the file and
    function."""

    def __init__(self, module, file):
        self.module, self.file = module, file

    def __call__(self, name, *args, **kw):
        fn = getattr(self.module, name, None)
        if not callable(fn):
            raise Unusable(f"{self.file} has no function {name}(); keep the name and arguments the "
                           f"stub had.")
        try:
            return fn(*args, **kw)
        except NotImplementedError:
            raise Unusable(f"{self.file}: {name}() is not written yet (it raises "
                           f"NotImplementedError); write it as its docstring says.") from None
        except Exception as e:
            at = line_in(e, getattr(self.module, "__file__", None))
            raise Unusable(f"{self.file}: {name}() raised {type(e).__name__}{at}: "
                           f"{explained(e)}.") from None


def explained(e):
    """An error's first sentence and, for an error a student is likely to meet, what to do."""
    text = str(e)
    if "leaf Variable" in text:  # exercise D: a parameter changed in place outside no_grad
        return f"{first_sentence(e)} (change parameters inside `with torch.no_grad():`)"
    if "saved tensor hooks" in text:  # exercise E: torch.func under check.by_hand's watch
        return ("torch.func builds the backward with autograd, and exercise E asks for it by hand; "
                "write each step's derivative (the hints)")
    keys = re.search(r"(Missing|Unexpected) key\(s\) in state_dict: (.*)", text)
    if keys:  # exercise D: a strict load_state_dict, whose first sentence names no key
        names = re.findall(r'"([^"]+)"', keys[2])
        which = "the routed model has and the baseline lacks" if keys[1] == "Missing" else \
            "the baseline has and the routed model lacks"
        return (f"load_state_dict() found {len(names)} keys that {which} ({names[0]}, ...); the "
                f"routers' are the keys the baseline lacks, so load with strict=False")
    return first_sentence(e)


def line_in(e, path):
    """' at line N': where in the student's file the exception e was raised, or '' if not there."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
    return f" at line {frames[-1].lineno}" if frames else ""


def first_sentence(text):
    """The first sentence of an error's text, without its full stop: a message stays one
    sentence."""
    return (str(text).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")


def load(name, folder=FOLDER):
    """The student's file folder/NAME.py, imported afresh (an edit counts at once); an import error
    is one sentence."""
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
        raise Unusable(f"{where} as {type(t).__name__} {case}; it must be a tensor of shape "
                       f"{tuple(shape)}.")
    if tuple(t.shape) != tuple(shape):
        raise Unusable(f"{where} of shape {tuple(t.shape)} {case}; it must be {tuple(shape)}.")
    if t.dtype != F64:
        raise Unusable(f"{where} in {t.dtype} {case}, whose inputs are float64; compute in the "
                       f"inputs' dtype.")
    if not torch.isfinite(t).all():
        raise Unusable(f"{where} with NaN or inf in it {case}.")
    return t


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def same(xs, ys):
    return len(xs) == len(ys) and all(close(x, y) for x, y in zip(xs, ys))


def verdict(student, fn, case, names, got, want, mistakes, reference):
    """Nothing if got equals want; else one sentence naming the wrong outputs and, if got is what
    one of the mistakes [(hint, output)] gives, that mistake."""
    bad = [n for n, a, b in zip(names, got, want) if not close(a, b)]
    if not bad:
        return
    wrong = f"{student.file}: {fn}() gives the wrong {and_list(bad)} {case}"
    for hint, out in mistakes:
        if same(got, out):
            raise Wrong(f"{wrong}: {hint}.")
    diff = max((a - b).abs().max().item() for a, b in zip(got, want))
    raise Wrong(f"{wrong} (at most {diff:.1e} away from {reference}'s); compare each step with the "
                f"formula in the file's docstring.")


def and_list(names):
    return f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]


# ---------------------------------------------------------------- A and B: the router's read

def route_inputs(n, tiny=False, B=2, T=3, D=8):
    """n sources of growing scale (with tiny, one of scale 1e-4, where the norm's eps matters), a
    query w and a gain g."""
    gen = torch.Generator().manual_seed(n + 10 * tiny)
    sources = [torch.randn(B, T, D, generator=gen, dtype=F64) * (i + 1) for i in range(n)]
    if tiny:
        sources[1] = sources[1] * 1e-4
    w = torch.randn(D, generator=gen, dtype=F64)
    return sources, w, 0.5 + torch.rand(D, generator=gen, dtype=F64)


def projects_router(w, g, heads=1):
    """The project's Router in float64 with query w and gain g."""
    router = Router(w.numel(), heads).to(F64)
    with torch.no_grad():
        router.query.copy_(w)
        router.norm.weight.copy_(g)
    return router


def project_route(sources, w, g, heads=1):
    """The project's Router with query w and gain g: read (B, T, D), alpha (B, T, H, n)."""
    with torch.no_grad():
        return projects_router(w, g, heads)(sources)


def project_grads(sources, w, g, G, heads=1):
    """Autograd through the project's Router, L = sum(read * G): [dL/ds_1, ..., dL/dw, dL/dg]."""
    router = projects_router(w, g, heads)
    sources = [s.clone().requires_grad_() for s in sources]
    inputs = [*sources, router.query, router.norm.weight]
    return list(torch.autograd.grad(router(sources)[0], inputs, G))


AXIS = "softmax over the wrong axis: alpha must sum to one over the n sources (alpha's last axis)"
NORM_MISTAKES = [  # (the step done wrong, as mistakes.route's keyword, the hint that names it)
    (dict(keys=M.gain_forgotten),
     "the gain g is forgotten: the key is g * s_i / sqrt(mean(s_i^2) + eps)"),
    (dict(keys=M.not_normed), "the keys are not RMS-normed: divide each s_i by sqrt(mean(s_i^2) + "
                              "eps) over its D channels"),
    (dict(keys=M.mean_subtracted), "the mean is subtracted (a LayerNorm): RMSNorm only divides by "
                                   "the root mean square"),
    (dict(keys=M.eps_missing), "eps is missing: sqrt(mean(s_i^2) + eps), which matters most for a "
                               "small source"),
    (dict(keys=M.eps_outside), "eps is added outside the square root: sqrt(mean(s_i^2) + eps)"),
    (dict(keys=M.l2_norm), "the key divides by the L2 norm sqrt(sum(s_i^2)): RMSNorm takes the "
                           "mean over the D channels, sqrt(mean(s_i^2) + eps)"),
    (dict(keys=M.rms_over_the_sources), "the mean of s^2 runs over the sources: each source is "
                                        "normed by its own D channels, mean(-1) of the stacked (B, "
                                        "T, n, D)"),
    (dict(keys=M.one_rms_for_all_sources), "one root mean square is taken over all the sources "
                                           "together: each source is normed by its own, over its D "
                                           "channels"),
    (dict(read=M.read_of_the_keys), "the read mixes the normed keys: it is sum_i alpha_i * s_i, "
                                    "the sources themselves"),
    (dict(read=M.mean_of_the_sources), "the read is a mean over the sources: it is the sum "
                                       "sum_i alpha_i * s_i (the weights already sum to one)"),
]
ROUTE_MISTAKES = NORM_MISTAKES + [
    (dict(weights=M.softmax_over_batch), AXIS + ", for each token"),
    (dict(weights=M.softmax_over_tokens), AXIS + ", for each token"),
    (dict(scores=M.scaled_scores), "the scores are divided by sqrt(D): the router has no 1/sqrt(D) "
                                   "and no temperature"),
]
HEAD_MISTAKES = NORM_MISTAKES + [
    (dict(keys=M.norm_per_head), "the RMSNorm is taken per head: norm each source over its full "
                                 "width D, then cut the keys into heads"),
    (dict(weights=M.softmax_over_heads), AXIS + ", for each token and head, not over the heads"),
    (dict(weights=M.softmax_over_tokens), AXIS + ", for each token and head"),
    (dict(weights=M.softmax_over_batch), AXIS + ", for each token and head"),
    (dict(channels=M.strided), "the heads take strided channels: head h owns the contiguous "
                               "channels h*D/H to (h+1)*D/H - 1 (unflatten the last dim to (H, "
                               "D/H))"),
    (dict(scores=M.one_score_for_all_heads), "every head uses the one-head score: head h's score "
                                             "is w_h . key_i[h], its own part of it"),
    (dict(scores=M.scaled_scores),
     "the scores are divided by sqrt(D/H): the router has no temperature"),
]


def read_and_alpha(student, fn, out, case, shapes):
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise Unusable(f"{student.file}: {fn}() returned {type(out).__name__} {case}; it must "
                       "return (read, alpha).")
    return tuple(returned(student, fn, what, t, shape, case)
                 for what, t, shape in zip(("read", "alpha"), out, shapes))


def heads_first(fn, alpha):
    """alpha as the project's Router gives it, (B, T, H, n): exercise A's route() returns one head's
    (B, T, n), the shape its docstring and the page give a student who has not met heads yet."""
    return alpha.unsqueeze(-2) if fn == "route" else alpha


def routed(student, fn, heads, sources, w, g, case, **kw):
    """The student's (read, alpha) for these inputs, alpha as (B, T, H, n)."""
    args = () if fn == "route" else (heads,)
    n, shape = len(sources), sources[0].shape
    out = student(fn, sources, w, g, *args, **kw)
    alpha_shape = shape[:2] + ((n,) if fn == "route" else (heads, n))
    read, alpha = read_and_alpha(student, fn, out, case, (shape, alpha_shape))
    return read, heads_first(fn, alpha)


def values(student, fn, cases, mistakes):
    """The read and the weights of each case against the project's Router's; a known mistake
    named."""
    for case, n, heads, tiny in cases:
        sources, w, g = route_inputs(n, tiny)
        got = routed(student, fn, heads, [s.clone() for s in sources], w.clone(), g.clone(), case)
        named = [(hint, M.route(sources, w, g, heads, **kw)) for kw, hint in mistakes]
        want = project_route(sources, w, g, heads)
        verdict(student, fn, case, ("read", "alpha"), got, want, named, "the project's Router")


GRAD_CASE = "for 3 sources, one of scale 1e-4"


def flowing(student, fn, heads=1):
    """The gradients of L = sum(read * G) that reach the 3 sources, w and g through the student's
    read, and autograd's through the project's Router; Blocked if the student's cannot learn: it
    changes an input in place, its read has no gradient, or none reaches one of the inputs."""
    case = GRAD_CASE + (f" and {heads} heads" if fn != "route" else "")
    sources, w, g = route_inputs(3, tiny=True)
    G = torch.randn(sources[0].shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    leaves = [t.clone().requires_grad_() for t in (*sources, w, g)]
    given = [t * 1 for t in leaves]  # not leaves, as in the model: an in-place edit shows
    read, _ = routed(student, fn, heads, given[:3], given[3], given[4], case)
    where = f"{student.file}: {fn}()"
    names = ["the source s_1", "s_2", "s_3", "the query w", "the gain g"]
    changed = [name for name, a, b in zip(names, given, (*sources, w, g)) if not torch.equal(a, b)]
    if changed:
        raise Blocked(f"{where} changes {and_list(changed)} in place {case}, and the model's "
                      "sources are tensors that later sublayers and the backward read too; compute "
                      "new tensors (s / r, not s.div_(r)).")
    if not read.requires_grad:
        raise Blocked(f"{where} returns a read that no gradient flows through {case}, so the "
                      "routing cannot learn; compute it outside torch.no_grad() and without "
                      ".detach().")
    try:
        got = torch.autograd.grad(read, leaves, G, allow_unused=True)
    except RuntimeError as e:
        if "inplace operation" not in str(e):
            raise
        raise Blocked(f"{where} changes in place a tensor that autograd saved for the backward "
                      f"{case}, so the training's backward fails; write the out-of-place form "
                      "(keys = keys / r, not keys.div_(r) or keys /= r).") from None
    got = [torch.zeros_like(t) if a is None else a for a, t in zip(got, leaves)]
    want = project_grads(sources, w, g, G, heads)
    blocked = [name for name, a, b in zip(names, got, want) if not a.any() and b.any()]
    if set(blocked) - {"the gain g"}:  # the query learns without g's: a forgotten gain trains
        raise Blocked(f"{where} lets no gradient reach {and_list(blocked)} through its read "
                      f"{case}, so the routing cannot learn; compute the keys and the weights "
                      "outside torch.no_grad() and without .detach() or .data.")
    return names, got, want, case


def gradients(student, fn, heads=1):
    """The gradients through the student's read equal autograd's through the project's Router."""
    names, got, want, case = flowing(student, fn, heads)
    bad = [name for name, a, b in zip(names, got, want) if not close(a, b)]
    if bad:
        diff = max((a - b).abs().max().item() for a, b in zip(got, want))
        raise Wrong(f"{student.file}: {fn}() passes the wrong gradient to {and_list(bad)} {case} "
                    f"(at most {diff:.1e} away from autograd through the project's Router), while "
                    "its read is right: part of it is cut from autograd (.detach(), .data, "
                    ".item(), numpy, torch.no_grad()) or changed in place.")


def properties(student, fn, cases=20):
    """Invariants of the formula on random inputs, each checked by its own comparison: the weights
    sum to one, a permutation of the sources permutes the weights and leaves the read, scaling a
    source leaves its key (eps 0), and a zero query gives uniform weights."""
    gen = torch.Generator().manual_seed(0)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=gen))
    for _ in range(cases):
        n, B, T, heads = pick(1, 5), pick(1, 3), pick(1, 4), 1 if fn == "route" else 2 ** pick(0, 2)
        D = heads * pick(1, 4)
        sources = [torch.randn(B, T, D, generator=gen, dtype=F64) * 3 ** pick(-2, 2)
                   for _ in range(n)]
        w = torch.randn(D, generator=gen, dtype=F64)
        g = 0.5 + torch.rand(D, generator=gen, dtype=F64)
        H = f", H={heads}" if fn != "route" else ""
        case = f"for random inputs (n={n}, B={B}, T={T}, D={D}{H})"
        each = " and head" if fn != "route" else ""
        run = lambda ss, w=w, **kw: routed(student, fn, heads, [s.clone() for s in ss], w.clone(),
                                           g.clone(), case, **kw)
        broken = f"{student.file}: {fn}() breaks an invariant of the formula {case}"
        read, alpha = run(sources)
        if not torch.allclose(alpha.sum(-1), torch.ones_like(alpha[..., 0]), **TOL):
            raise Wrong(f"{broken}: its weights do not sum to one over the sources for each "
                        f"token{each}; take the softmax over the n sources.")
        p = torch.randperm(n, generator=gen)
        read_p, alpha_p = run([sources[i] for i in p])
        if not (close(alpha_p, alpha[..., p]) and close(read_p, read)):
            raise Wrong(f"{broken}: reordering the sources does not reorder the weights alike and "
                        "leave the read as it was; treat every source alike, whatever its place in "
                        "the list.")
        j, c = pick(0, n - 1), 10 ** (2 * torch.rand((), generator=gen, dtype=F64).item() - 1)
        scaled = [s * c if i == j else s for i, s in enumerate(sources)]
        if not close(run(scaled, eps=0.0)[1], run(sources, eps=0.0)[1]):
            raise Wrong(f"{broken}: scaling source {j + 1} by {c:.3g} changes the weights with eps "
                        "= 0, so its key is not scale-free; the key g * s / sqrt(mean(s^2)) is the "
                        "same for c * s.")
        if not close(run(sources, w=torch.zeros_like(w))[1], torch.full_like(alpha, 1 / n)):
            raise Wrong(f"{broken}: a zero query w does not give every source the weight 1/n; with "
                        "w = 0 every score w . key_i is 0.")


# A's and B's checks pin down the values on fixed inputs (one source, a source of scale 1e-4,
# for B heads of one channel), the gradients of the read, and the formula's invariants

def router_read(student):
    """route() against the project's Router (one head): 3 sources, one source, a source of scale
    1e-4; then its read's gradients and the formula's invariants."""
    values(student, "route", [("for 3 sources", 3, 1, False), ("for one source", 1, 1, False),
                              ("for 3 sources, one of scale 1e-4", 3, 1, True)], ROUTE_MISTAKES)
    gradients(student, "route")
    properties(student, "route")


def multi_head(student):
    """route_heads() against the project's multi-head Router: 2 heads, one source, 8 heads of one
    channel with a source of scale 1e-4, and one head; then its read's gradients (2 heads) and the
    formula's invariants."""
    values(student, "route_heads",
           [("for 3 sources and 2 heads", 3, 2, False), ("for one source and 4 heads", 1, 4, False),
            ("for 3 sources, one of scale 1e-4, and 8 heads of one channel", 3, 8, True),
            ("for 3 sources and one head", 3, 1, False)], HEAD_MISTAKES)
    gradients(student, "route_heads", heads=2)
    properties(student, "route_heads")


# ---------------------------------------------------------------- C: the sources of a mode

MODES = [  # (residual, routing options, the name a message gives it)
    ("delta", {}, "delta (per sublayer)"),
    ("attnres", dict(n_route_blocks=4), "attnres with 4 blocks"),
    ("attnres", dict(n_route_blocks=2), "attnres with 2 blocks"),
    ("delta_block", dict(n_route_blocks=4), "delta_block with 4 blocks"),
    ("delta_block", dict(n_route_blocks=2, route_partial=True),
     "delta_block with 2 blocks (route_partial)"),
    ("delta_block", dict(n_route_blocks=1), "delta_block with 1 block"),  # reads only e: one source
]


def pieces(S=8, B=2, T=3, D=8):
    """e and the sublayer outputs v_1..v_S (v_3 of scale 1e-4), float64."""
    gen = torch.Generator().manual_seed(0)
    e, *vs = [torch.randn(B, T, D, generator=gen, dtype=F64) for _ in range(S + 1)]
    vs[2] = vs[2] * 1e-4
    return e, vs


def mode_config(residual, kw):
    return GPTConfig(n_layer=4, n_head=1, n_embd=8, vocab_size=11, block_size=8, residual=residual,
                     **kw)


def project_reads(config, e, vs):
    """The sources the project's Stream gives before each sublayer k = 1..S, and for attnres after
    the last (its final router's read)."""
    stream, reads = Stream(e, config), []
    for v in vs:
        reads.append(stream.sources())
        stream.write(v)
    return reads + ([stream.sources()] if config.residual == "attnres" else [])


def reads_of(write, sources, e, vs, block_len, route_partial, final):
    """The same reads from a write() and a sources() of the exercise's form (copies: a later
    in-place edit does not change them)."""
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
        if not (isinstance(out, (tuple, list)) and len(out) == 2
                and isinstance(out[0], (list, tuple))
                and (out[1] is None or isinstance(out[1], torch.Tensor))):
            raise Unusable(f"{student.file}: write() returned {type(out).__name__} after sublayer "
                           f"{at} of {mode}; it must return (blocks, partial): a list of tensors, "
                           "a tensor or None.")
        k[0] = at + 1
        return list(out[0]), out[1]

    def sources(blocks, partial, route_partial):
        out = student("sources", blocks, partial, route_partial)
        case = f"{when(k[0], len(vs))} of {mode}"
        if not isinstance(out, (list, tuple)):
            raise Unusable(f"{student.file}: sources() returned {type(out).__name__} {case}; it "
                           "must return a list.")
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
    text = " + ".join(name if n == 1 else f"-{name}" if n == -1 else f"{n} {name}"
                      for name, n in terms)
    return text.replace("+ -", "- ") or "0"


def listed(ts, e, vs):
    return "[" + ", ".join(describe(combination(t, e, vs)) for t in ts) + "]"


def one_off(got, want):
    """(i, 'missing') or (i, 'counted twice') where got is want less its source i or with it
    twice."""
    for i, t in enumerate(want):
        if same(got, want[:i] + want[i + 1:]):
            return i, "missing"
        if same(got, want[:i + 1] + [t] + want[i + 1:]):
            return i, "counted twice"
    return None


SOURCE_MISTAKES = [  # (write, sources, hint)
    (M.official_write, M.right_sources,
     "this is the official code's bookkeeping, its partial the stream x (e included, never reset) "
     "and a new block x - blocks[-1]; a block's source is the sum of its own sublayers' outputs, "
     "and the partial the current block's"),
    (M.minus_last_write, M.right_sources,
     "a block's source is its partial sum itself, not partial - blocks[-1] (the official code's "
     "bookkeeping, whose partial is the stream)"),
    (M.not_reset_write, M.right_sources,
     "the partial sum is not reset when its block completes (set it back to None), so each block "
     "also carries the earlier blocks' outputs"),
    (M.last_only_write, M.right_sources,
     "each block keeps only its last sublayer's output; add v to the partial sum"),
    (M.right_write, M.partial_always_sources,
     "route_partial is False here, so the partial sum is no source: only e and the completed "
     "blocks are"),
    (M.right_write, M.partial_never_sources,
     "the current block's partial sum is missing: with route_partial (attnres always) it is read "
     "while its block is not empty"),
]


# C's first check pins down every read's tensors and order in six modes; its second, the sum
# the sources telescope to, which the zero-init identity (exercise D) rests on

def sources_match_stream(student):
    """write() and sources() give the project's Stream's sources, in order, before every sublayer of
    each mode (and for attnres after the last)."""
    e, vs = pieces()
    for residual, kw, mode in MODES:
        config = mode_config(residual, kw)
        L, S = config.n_sublayers // config.n_route_blocks, config.n_sublayers
        final = residual == "attnres"
        want = project_reads(config, e, vs)
        got = student_reads(student, e, vs, L, config.route_partial, final, mode)
        for k, (a, b) in enumerate(zip(got, want), start=1):
            if same(a, b):
                continue
            wrong = (f"{student.file}: write() and sources() give {mode} the sources "
                     f"{listed(a, e, vs)} {when(k, S)}, where the project's Stream reads "
                     f"{listed(b, e, vs)}")
            for write, sources, hint in SOURCE_MISTAKES:
                if same(a, reads_of(write, sources, e, vs, L, config.route_partial, final)[k - 1]):
                    raise Wrong(f"{wrong}: {hint}.")
            off = one_off(a, b)
            if off:
                raise Wrong(f"{wrong}: {describe(combination(b[off[0]], e, vs))} is {off[1]}.")
            raise Wrong(f"{wrong}.")
        sources_gradients(student, e, vs, config, mode)


def sources_gradients(student, e, vs, config, mode):
    """The gradient of a weighted sum of every read reaches e and each v_k as through the project's
    Stream: no sum is cut from autograd."""
    L, final = config.n_sublayers // config.n_route_blocks, config.residual == "attnres"
    leaves = [t.clone().requires_grad_() for t in (e, *vs)]
    weigh = lambda reads: sum((s * (10 * k + i + 1)).sum() for k, read in enumerate(reads)
                              for i, s in enumerate(read))  # each slot its own weight
    mine = student_reads(student, leaves[0], leaves[1:], L, config.route_partial, final, mode)
    theirs = project_reads(config, leaves[0], leaves[1:])
    # allow_unused: the last v is read by attnres's final router only; no graph: every read cut
    grads = lambda reads: torch.autograd.grad(weigh(reads), leaves, allow_unused=True) \
        if weigh(reads).requires_grad else [None] * len(leaves)
    zero = lambda t, like: torch.zeros_like(like) if t is None else t
    names = ["e"] + [f"v{j}" for j in range(1, len(vs) + 1)]
    bad = [n for n, a, b, x in zip(names, grads(mine), grads(theirs), leaves)
           if not close(zero(a, x), zero(b, x))]
    if bad:
        raise Wrong(f"{student.file}: write() and sources() give {mode} the right sources, but the "
                    f"gradient through them does not reach {and_list(bad)} as through the "
                    f"project's Stream: a sum is cut from autograd (.detach(), .data or "
                    f"torch.no_grad()); keep every sum in autograd.")


def sources_telescope(student):
    """The sources sum to the stream x_{k-1} = e + v_1 + ... + v_{k-1} in attnres, delta and
    delta_block with route_partial; plain delta_block's to the stream where the current block
    began."""
    e, vs = pieces()
    for residual, kw, mode in MODES:
        config = mode_config(residual, kw)
        L, S = config.n_sublayers // config.n_route_blocks, config.n_sublayers
        got = student_reads(student, e, vs, L, config.route_partial, residual == "attnres", mode)
        for k, read in enumerate(got, start=1):
            done = k - 1 if config.route_partial else (k - 1) // L * L  # how many v's the sum holds
            total = sum(read, torch.zeros_like(e))
            if close(total, e + sum(vs[:done], torch.zeros_like(e))):
                continue
            want = torch.tensor([1.0] * (1 + done) + [0.0] * (S - done), dtype=F64)
            have = combination(total, e, vs)
            wrong = (f"{student.file}: write() and sources() give {mode} sources {when(k, S)} that "
                     f"sum to {describe(have)}, not to x_{done} = {describe(want)}"
                     + ("" if config.route_partial
                        else ", the stream where the current block began"))
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
        router.query.normal_()  # the official code's init (PyTorch's default normal): not uniform
        router.norm.weight.uniform_(0.5, 1.5)
    return router


# D's first check pins down the init of one router, query and gain; its second, that the converted
# model is the baseline's function (the identity itself, exact in float64 with LayerNorm's eps 0)

def zero_init_router(student):
    """init_router_() sets a router's query and gain to what GPT's own init gives them."""
    ref = GPT(mode_config("delta", {})).routers[0]  # as GPT._init_weights leaves a router
    for heads in (1, 2):
        router = random_router(heads)
        student("init_router_", router)
        w, g = router.query, router.norm.weight
        where = f"{student.file}: init_router_() leaves"
        if not torch.equal(w, ref.query):
            raise Wrong(f"{where} the query w not zero ({w.abs().max().item():.2g} at most): at "
                        "init every score w . key_i must be 0, so that alpha_i = 1/n and the read "
                        "is a multiple of the stream.")
        if torch.equal(g, torch.zeros_like(g)):
            raise Wrong(f"{where} the gain g at zero: then w's gradient, the key g * RMSNorm(s_i), "
                        "is zero too and routing never learns; start g at one, as RMSNorm does.")
        if not torch.equal(g, ref.norm.weight):
            lo, hi = g.min().item(), g.max().item()
            raise Wrong(f"{where} the gain g at {lo:.2g}{f' to {hi:.2g}' if hi > lo else ''}, not "
                        "one; start it at one, as RMSNorm (and GPT._init_weights) does.")


def unit_gain_baseline():
    """A tiny baseline whose stream's variance is far above LayerNorm's eps (test_model.py's
    unit_gain_)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            big = "wte" in name or "wpe" in name
            p.normal_(0, 1.0 if big else 1 / math.sqrt(p.size(1)) if p.dim() == 2 else 0.1)
    return model


def exact(model):
    """The model in float64 with LayerNorm's eps 0: LN(c x) = LN(x) for every c > 0, the identity
    exact."""
    model = deepcopy(model).to(F64).eval()
    for m in model.modules():
        if isinstance(m, LayerNorm):
            m.eps = 0.0
    return model


CONVERSIONS = [  # modes whose sources telescope, so that the identity holds
    ("delta", {}), ("attnres", dict(n_route_blocks=2, route_heads=2)),
    ("delta_block", dict(n_route_blocks=2, route_partial=True)),
    ("attnres", dict(n_route_blocks=1)),
]


def zero_init_convert(student):
    """convert() gives a routed model with the baseline's weights, zero queries, and the baseline's
    logits (float64, LayerNorm eps 0)."""
    base = unit_gain_baseline()
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = exact(base)(idx)[0]
    for residual, kw in CONVERSIONS:
        args = ", ".join(["baseline", residual] + [f"{k}={v}" for k, v in kw.items()])
        where = f"{student.file}: convert({args})"
        model = student("convert", deepcopy(base), residual, **kw)
        if not isinstance(model, GPT):
            raise Unusable(f"{where} returned {type(model).__name__}; it must return a "
                           f"delta_gpt.GPT.")
        asked = asdict(replace(base.config, residual=residual, **kw))
        changed = [k for k, v in asdict(model.config).items() if asked.get(k) != v]
        if changed:
            raise Wrong(f"{where} built {changed[0]}={getattr(model.config, changed[0])!r} where "
                        f"{changed[0]}={asked[changed[0]]!r} was asked; build "
                        f"GPT(replace(baseline.config, residual=residual, **routing)).")
        sd, base_sd = model.state_dict(), base.state_dict()
        lost = [k for k in base_sd
                if k not in sd or not torch.equal(sd[k].to(base_sd[k].dtype), base_sd[k])]
        if lost:
            raise Wrong(f"{where} does not hold the baseline's {lost[0]}: load the baseline's "
                        "state_dict into the routed model (strict=False: the routers' keys are the "
                        "ones it lacks).")
        if any(not torch.equal(r.query, torch.zeros_like(r.query)) for r in model.routers):
            raise Wrong(f"{where} has a query w that is not zero at init, so the routing is not "
                        "uniform and the read is no multiple of the stream; init every router with "
                        "init_router_().")
        out = exact(model)(idx)[0]
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        if not err < 1e-12:
            raise Wrong(f"{where} does not compute the baseline's function: its logits are "
                        f"{err:.1e} (relative) away from the baseline's in float64 with LayerNorm "
                        "eps 0.")


# ---------------------------------------------------------------- E: the router's backward

def project_backward(sources, w, g, grad_read):
    """Autograd through the project's Router: (dL/ds_i list, dL/dw, dL/dg)."""
    grads = project_grads(sources, w, g, grad_read)
    return grads[:-2], grads[-2], grads[-1]


BACKWARD_MISTAKES = [  # (the backward with the mistake, the hint that names it)
    (partial(M.backward, softmax=M.softmax_second_term_missing),
     "the softmax's backward misses its second term: dL/dlogit_i = alpha_i (dL/dalpha_i - sum_j "
     "alpha_j dL/dalpha_j)"),
    (partial(M.backward, softmax=M.softmax_second_term_added),
     "the softmax's backward adds its second term: dL/dlogit_i = alpha_i (dL/dalpha_i - sum_j "
     "alpha_j dL/dalpha_j), a minus"),
    (partial(M.backward, dlogit=M.r_constant),
     "r_i = 1/rms(s_i) is treated as a constant: it depends on s_i too, dr_i/ds_i = "
     "-r_i^3 s_i / D"),
    (partial(M.backward, dlogit=M.one_over_D_missing),
     "the 1/D of the mean is missing: dr_i/ds_i = -r_i^3 s_i / D"),
    (partial(M.backward, dlogit=M.r_term_added),
     "the norm's term has the wrong sign: dr_i/ds_i = -r_i^3 s_i / D, so d logit_i / ds_i = (w * "
     "g) r_i - logit_i r_i^2 s_i / D"),
    (partial(M.backward, grad_s=M.direct_path_missing),
     "the direct path is missing: read = sum_i alpha_i s_i gives s_i the gradient alpha_i * "
     "grad_read besides the one through its score"),
    (partial(M.backward, grad_s=M.score_path_missing),
     "the path through the scores is missing: s_i also moves its own score w . key_i"),
    (partial(M.backward, grad_w=M.query_grad_without_gain),
     "dL/dw forgets the gain: d logit_i / dw = key_i = g * s_i * r_i"),
    (partial(M.backward, grad_g=M.gain_grad_without_query),
     "dL/dg forgets the query: d logit_i / dg = w * s_i * r_i"),
    (M.every_sign_flipped,
     "every gradient has the wrong sign: return dL/dx itself, the direction that increases L (the "
     "optimizer subtracts it)"),
]


def stacked(grads):
    return torch.stack(grads[0]), grads[1], grads[2]


def by_hand(student, sources, w, g, G, case):
    """The student's route_backward(), watched: autograd saves tensors for a backward only when a
    graph is built, which a backward by hand on inputs without requires_grad never does."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        out = student("route_backward", [s.clone() for s in sources], w.clone(), g.clone(),
                      G.clone())
    if saved:
        raise Wrong(f"{student.file}: route_backward() builds its backward with autograd "
                    f"(torch.autograd.grad or .backward()) {case}; exercise E asks for it by hand: "
                    f"write each step's derivative (the hints).")
    return out


# E's check pins down the three gradients, by hand, on the same fixed inputs as exercise A's values

def router_backward(student):
    """route_backward() against autograd through the project's Router, float64: 3 sources, one
    source, a source of scale 1e-4; and no autograd in it."""
    for case, n, tiny in [("for 3 sources", 3, False), ("for one source", 1, False),
                          ("for 3 sources, one of scale 1e-4", 3, True)]:
        sources, w, g = route_inputs(n, tiny)
        G = torch.randn(sources[0].shape, generator=torch.Generator().manual_seed(7), dtype=F64)
        out = by_hand(student, sources, w, g, G, case)
        if not (isinstance(out, (tuple, list)) and len(out) == 3
                and isinstance(out[0], (list, tuple)) and len(out[0]) == n):
            raise Unusable(f"{student.file}: route_backward() returned {type(out).__name__} "
                           f"{case}; it must return (grad_sources, a list of {n} tensors, grad_w, "
                           "grad_g).")
        grad_s = [returned(student, "route_backward", "a source's gradient", t, G.shape, case)
                  for t in out[0]]
        got = (torch.stack(grad_s),
               returned(student, "route_backward", "grad_w", out[1], w.shape, case),
               returned(student, "route_backward", "grad_g", out[2], w.shape, case))
        named = [(hint, stacked(fn(sources, w, g, G))) for fn, hint in BACKWARD_MISTAKES]
        verdict(student, "route_backward", case, ("grad_sources", "grad_w", "grad_g"), got,
                stacked(project_backward(sources, w, g, G)), named, "autograd")


CHECKS = {  # each exercise's file and its checks, in the page's order
    "router_read": [router_read],
    "multi_head": [multi_head],
    "sources": [sources_match_stream, sources_telescope],
    "zero_init": [zero_init_router, zero_init_convert],
    "router_backward": [router_backward],
}
