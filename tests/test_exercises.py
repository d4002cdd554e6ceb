"""The exercises in exercises/: the reference answers (tests/exercise_answers.py) pass every check, each
known mistake is named by its check, a bad file gets one sentence and the other exercises still run, the
pages show these answers and the checks' messages, and train_mine trains with the student's router. Nothing
here reads or writes the student's files in exercises/ (a student who solved them runs the suite green): the
checks get the answers as a namespace, or a copy of the folder with the answers in it. Whether the stubs
there are unsolved is for check_pages, which runs the page's `python -m pytest exercises` in a fresh clone."""
import inspect
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch

import exercise_answers as A
import train as T
from conftest import ROOT, cfg_for, cli_args, train_losses
from delta_gpt import Router
from exercises import check, mistakes as M, train_mine
from plumbing import checkpoint as CK

FILES = {"router_read": ["route"], "multi_head": ["route_heads"], "sources": ["write", "sources"],
         "zero_init": ["init_router_", "convert"], "router_backward": ["route_backward"]}
ANSWERS = [name for names in FILES.values() for name in names]


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    """train_mine runs from the repository root only (data/ and runs/ are there), as `make test` does."""
    monkeypatch.chdir(ROOT)


def student(file, **functions):
    """The answers as the student's file exercises/FILE.py, with `functions` in place of theirs."""
    return check.Student(types.SimpleNamespace(**{**{n: getattr(A, n) for n in ANSWERS}, **functions}),
                         f"exercises/{file}.py")


def unsolved(file):
    """The stub of exercises/FILE.py as a student first meets it: each function not written yet."""
    def stub(*args, **kw):
        raise NotImplementedError
    return check.Student(types.SimpleNamespace(**{n: stub for n in FILES[file]}), f"exercises/{file}.py")


def edited(name, old, new):
    """The answer `name` with `old` replaced by `new` in its source: a mistake as a student would make it."""
    source = inspect.getsource(getattr(A, name))
    assert old in source, f"{old!r} is not in the answer {name}()"
    namespace = dict(vars(A))
    exec(source.replace(old, new), namespace)
    return namespace[name]


def verdict(fn, s):
    """The one sentence the check fn gives the student s, or None when it passes."""
    try:
        fn(s)
    except check.Wrong as e:
        return str(e)
    return None


def one_sentence(message, file, function):
    """One line naming the file and the function, ending in a full stop, with no second sentence."""
    return (message.startswith(f"exercises/{file}.py") and function in message and "\n" not in message
            and message.endswith(".") and not re.search(r"\. [A-Z]", message))


# ---------------------------------------------------------------- (a) the answers pass; the checker is right

@pytest.mark.parametrize("file", list(FILES))
def test_answers_pass_every_check(file):
    assert [verdict(fn, student(file)) for fn in check.CHECKS[file]] == [None] * len(check.CHECKS[file])


@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize("n,tiny", [(3, False), (1, False), (3, True)])
def test_written_out_router_and_backward_are_the_projects(n, tiny, heads):
    """The checker's route_of and backward_of, with no mistake asked for, are the project's Router and
    autograd: each named mistake is one change away from the right answer."""
    sources, w, g = check.route_inputs(n, tiny)
    for a, b in zip(M.route(sources, w, g, heads), check.project_route(sources, w, g, heads)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    G = torch.randn(sources[0].shape, dtype=torch.float64)
    mine, ref = M.backward(sources, w, g, G), check.project_backward(sources, w, g, G)
    for a, b in zip([*mine[0], *mine[1:]], [*ref[0], *ref[1:]]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_written_out_sources_are_the_streams():
    e, vs = check.pieces()
    for residual, kw, _ in check.MODES:
        config = check.mode_config(residual, kw)
        L = config.n_sublayers // config.n_route_blocks
        mine = check.reads_of(M.right_write, M.right_sources, e, vs, L, config.route_partial,
                              residual == "attnres")
        ref = check.project_reads(config, e, vs)
        assert [len(r) for r in mine] == [len(r) for r in ref]
        assert all(torch.equal(a, b) for m, r in zip(mine, ref) for a, b in zip(m, r))


# ---------------------------------------------------------------- (b) each known mistake is named

KEYS = "keys = g * s / (s.square().mean(-1, keepdim=True) + eps).sqrt()"
CUT = "keys, s = keys.unflatten(-1, (heads, -1)), s.unflatten(-1, (heads, -1))"
PER_HEAD = ("s = s.unflatten(-1, (heads, -1))\n"
            "    keys = g.view(heads, -1) * s / (s.square().mean(-1, keepdim=True) + eps).sqrt()")
OFFICIAL = ("partial = (blocks[0] if partial is None else partial) + v  # the stream x, as the official\n"
            "    if k % block_len == 0:\n"
            "        return blocks + [partial - blocks[-1]], partial\n")
LAYER_NORM = ("keys = g * (s - s.mean(-1, keepdim=True)) / (s.var(-1, unbiased=False, keepdim=True) + "
              "eps).sqrt()")
SHARED = ".sum((-2, -1))[..., None].expand(*keys.shape[:-1]).softmax(dim=-2)"
MISTAKES = [  # (file, function, old, new, what the message must say)
    ("router_read", "route", "softmax(dim=-1)", "softmax(dim=1)", "softmax over the wrong axis"),
    ("router_read", "route", "softmax(dim=-1)", "softmax(dim=0)", "softmax over the wrong axis"),
    ("router_read", "route", "keys = g * s", "keys = s", "the gain g is forgotten"),
    ("router_read", "route", KEYS, "keys = g * s", "the keys are not RMS-normed"),
    ("router_read", "route", KEYS, LAYER_NORM, "the mean is subtracted"),
    ("router_read", "route", " + eps).sqrt()", ").sqrt()", "eps is missing"),
    ("router_read", "route", "(s.square().mean(-1, keepdim=True) + eps).sqrt()",
     "(s.square().mean(-1, keepdim=True).sqrt() + eps)", "eps is added outside the square root"),
    ("router_read", "route", "(keys @ w)", "(keys @ w / s.size(-1) ** 0.5)", "divided by sqrt(D)"),
    ("router_read", "route", "* s).sum(-2)", "* keys).sum(-2)", "the read mixes the normed keys"),
    ("multi_head", "route_heads", KEYS + "  # normed over the full width D, then cut\n    " + CUT, PER_HEAD,
     "the RMSNorm is taken per head"),
    ("multi_head", "route_heads", "softmax(dim=-2)", "softmax(dim=-1)", "not over the heads"),
    ("multi_head", "route_heads", "keys = g * s", "keys = s", "the gain g is forgotten"),
    ("multi_head", "route_heads", ".sum(-1).softmax(dim=-2)", SHARED, "every head uses the one-head score"),
    ("sources", "write", "[partial], None", "[partial], partial", "not reset"),
    ("sources", "write", "partial = v if partial is None else partial + v", "partial = v", "only its last"),
    ("sources", "write", "partial = v if partial is None else partial + v\n", OFFICIAL,
     "the official code's bookkeeping"),
    ("sources", "write", "[partial], None", "[partial - blocks[-1]], None", "not partial - blocks[-1]"),
    ("sources", "sources", "route_partial and partial", "partial", "route_partial is False here"),
    ("sources", "sources", "blocks + [partial] if", "list(blocks) if", "the current block's partial sum is"),
    ("sources", "sources", "return blocks", "return [blocks[0]] + blocks", "e is counted twice"),
    ("zero_init", "init_router_", "router.query.zero_()", "torch.nn.init.normal_(router.query)", "not zero"),
    ("zero_init", "init_router_", "fill_(1.0)", "fill_(0.0)", "routing never learns"),
    ("zero_init", "init_router_", "fill_(1.0)", "fill_(2.0)", "start it at one"),
    ("zero_init", "init_router_", "with torch.no_grad():", "if True:", "with torch.no_grad()"),
    ("zero_init", "convert", "init_router_(router)", "torch.nn.init.normal_(router.query)",
     "not zero at init"),
    ("zero_init", "convert", "model.load_state_dict(baseline.state_dict(), strict=False)",
     "baseline.state_dict()", "does not hold the baseline's"),
    ("zero_init", "convert", "residual=residual, **routing", "residual=residual", "was asked"),
    ("router_backward", "route_backward", " - (alpha * grad_alpha).sum(-1, keepdim=True)", "", "second term"),
    ("router_backward", "route_backward", " - logits.unsqueeze(-1) * r.square() * s / s.size(-1)", "",
     "treated as a constant"),
    ("router_backward", "route_backward", " / s.size(-1)", "", "the 1/D of the mean is missing"),
    ("router_backward", "route_backward", "alpha.unsqueeze(-1) * grad_read.unsqueeze(-2) + ", "",
     "the direct path is missing"),
    ("router_backward", "route_backward", " + grad_logits.unsqueeze(-1) * dlogit_ds", "",
     "through the scores"),
    ("router_backward", "route_backward", "unsqueeze(-1) * keys)", "unsqueeze(-1) * s * r)",
     "dL/dw forgets the gain"),
    ("router_backward", "route_backward", "* w * s * r).sum", "* s * r).sum", "dL/dg forgets the query"),
    # issue 42's mistakes that got only "compare each step with the formula"
    ("router_read", "route", ".square().mean(-1, keepdim=True)", ".square().sum(-1, keepdim=True)",
     "divides by the L2 norm"),
    ("router_read", "route", ".square().mean(-1, keepdim=True)", ".square().mean(-2, keepdim=True)",
     "the mean of s^2 runs over the sources"),
    ("router_read", "route", ".square().mean(-1, keepdim=True)", ".square().mean((-2, -1), keepdim=True)",
     "one root mean square is taken over all the sources"),
    ("router_read", "route", "* s).sum(-2)", "* s).mean(-2)", "the read is a mean over the sources"),
    ("multi_head", "route_heads", ".square().mean(-1, keepdim=True)", ".square().sum(-1, keepdim=True)",
     "divides by the L2 norm"),
    ("router_backward", "route_backward", "return list(grad_s.unbind(-2)), grad_w, grad_g",
     "return [-t for t in grad_s.unbind(-2)], -grad_w, -grad_g", "every gradient has the wrong sign"),
    ("router_backward", "route_backward", "* r.square() * s / s.size(-1)",
     "* r.square() * s / s.size(-1) * -1", "the norm's term has the wrong sign"),
    ("router_backward", "route_backward", "(grad_alpha - (alpha", "(grad_alpha + (alpha",
     "adds its second term"),
]


@pytest.mark.parametrize("file,name,old,new,hint", MISTAKES, ids=[f"{m[1]}-{m[4][:28]}" for m in MISTAKES])
def test_each_known_mistake_is_named(file, name, old, new, hint):
    messages = [verdict(fn, student(file, **{name: edited(name, old, new)})) for fn in check.CHECKS[file]]
    assert any(m and hint in m for m in messages), messages
    assert all(one_sentence(m, file, f"{name}(") for m in messages if m), messages


def strided_heads(sources, w, g, heads, eps=1e-6):
    """Head h takes the channels h, h+H, h+2H, ...: strided groups instead of contiguous ones."""
    s = torch.stack(sources, dim=-2)
    keys = g * s / (s.square().mean(-1, keepdim=True) + eps).sqrt()
    keys, s = [t.unflatten(-1, (-1, heads)).transpose(-1, -2) for t in (keys, s)]
    alpha = (keys * w.view(-1, heads).t()).sum(-1).softmax(dim=-2)
    read = (alpha.unsqueeze(-1) * s).sum(-3).transpose(-1, -2).flatten(-2)
    return read, alpha.transpose(-1, -2)


def test_strided_heads_are_named():
    message = verdict(check.multi_head, student("multi_head", route_heads=strided_heads))
    assert "the heads take strided channels" in message
    assert one_sentence(message, "multi_head", "route_heads()")


def test_sources_that_do_not_telescope_say_what_is_missing_or_twice():
    said = {}
    for name, old, new in [("write", "[partial], None", "[partial], partial"),
                           ("sources", "blocks + [partial] if", "list(blocks) if"),
                           ("sources", "route_partial and partial", "partial")]:
        said[new] = verdict(check.sources_telescope, student("sources", **{name: edited(name, old, new)}))
    assert said["[partial], partial"] == ("exercises/sources.py: write() and sources() give delta (per "
                                          "sublayer) sources before sublayer 2 that sum to e + 2 v1, not to "
                                          "x_1 = e + v1: v1 counted twice.")
    assert said["list(blocks) if"].endswith("attnres with 4 blocks sources before sublayer 2 that sum to e, "
                                            "not to x_1 = e + v1: v1 missing.")
    assert said["partial"].endswith("delta_block with 4 blocks sources before sublayer 2 that sum to e + v1, "
                                    "not to x_0 = e, the stream where the current block began: v1 read "
                                    "before its block is complete.")


def test_a_wrong_answer_that_no_mistake_explains_still_says_what_differs():
    message = verdict(check.router_read, student("router_read", route=lambda s, w, g: A.route(s, w * 1.5, g)))
    assert message.startswith("exercises/router_read.py: route() gives the wrong read and alpha for 3 "
                              "sources (at most")
    assert one_sentence(message, "router_read", "route()")


# ---------------------------------------------------------------- (b2) gradients and invariants

def keys_under_no_grad(sources, w, g, eps=1e-6):
    s = torch.stack(sources, dim=-2)
    with torch.no_grad():  # the keys and the weights untracked: the router that never learns
        keys = g * s / (s.square().mean(-1, keepdim=True) + eps).sqrt()
        alpha = (keys @ w).softmax(dim=-1)
    return (alpha.unsqueeze(-1) * s).sum(-2), alpha


def keys_divided_in_place(sources, w, g, eps=1e-6):
    s = torch.stack(sources, dim=-2)
    keys = g * s.div_((s.square().mean(-1, keepdim=True) + eps).sqrt())  # s.square() saved s
    alpha = (keys @ w).softmax(dim=-1)
    return (alpha.unsqueeze(-1) * torch.stack(sources, dim=-2)).sum(-2), alpha


GRADIENT_CASES = [  # (what a student writes in route(), what the check says, the check's class)
    (keys_under_no_grad, "lets no gradient reach the query w and the gain g", check.Blocked),
    (lambda s, w, g, eps=1e-6: tuple(t.detach() for t in A.route(s, w, g, eps)),
     "returns a read that no gradient flows through", check.Blocked),
    (edited("route", "torch.stack(sources, dim=-2)", "torch.stack([x.detach() for x in sources], dim=-2)"),
     "lets no gradient reach the source s_1, s_2 and s_3", check.Blocked),
    (edited("route", "keys = g * s / (s.square()", "keys = g * s.detach() / (s.detach().square()"),
     "passes the wrong gradient to the source s_1, s_2 and s_3", check.Wrong),
    (keys_divided_in_place, "changes in place a tensor that autograd saved for the backward", check.Blocked),
    (edited("route", "return read, alpha", "sources[0].mul_(2)\n    return read, alpha"),
     "changes the source s_1 in place", check.Blocked),
    (edited("route", "(keys @ w)", "(keys @ w.detach())"), "lets no gradient reach the query w", check.Blocked),
]


@pytest.mark.parametrize("route,says,kind", GRADIENT_CASES, ids=[c[1][:30] for c in GRADIENT_CASES])
def test_a_route_that_cannot_learn_is_named(route, says, kind):
    with pytest.raises(check.Wrong) as e:
        check.router_read(student("router_read", route=route))
    assert type(e.value) is kind and says in str(e.value), str(e.value)
    assert one_sentence(str(e.value), "router_read", "route(")


def test_route_heads_under_no_grad_is_named():
    route_heads = edited("route_heads", "    s = torch.stack", "    torch.set_grad_enabled(False)\n    s = torch.stack")
    try:
        message = verdict(check.multi_head, student("multi_head", route_heads=route_heads))
    finally:
        torch.set_grad_enabled(True)
    assert "route_heads() returns a read that no gradient flows through" in message
    assert one_sentence(message, "multi_head", "route_heads(")


def by_autograd(sources, w, g, grad_read, eps=1e-6):
    leaves = [t.clone().requires_grad_() for t in (*sources, w, g)]
    grads = torch.autograd.grad(A.route(leaves[:-2], *leaves[-2:], eps)[0], leaves, grad_read)
    return list(grads[:-2]), grads[-2], grads[-1]


def by_torch_func(sources, w, g, grad_read, eps=1e-6):
    _, vjp = torch.func.vjp(lambda s, w, g: A.route(s, w, g, eps)[0], sources, w, g)
    return vjp(grad_read)


@pytest.mark.parametrize("route_backward,says", [
    (by_autograd, "route_backward() builds its backward with autograd (torch.autograd.grad or .backward())"),
    (by_torch_func, "torch.func builds the backward with autograd, and exercise E asks for it by hand"),
])
def test_a_backward_by_autograd_is_named(route_backward, says):
    message = verdict(check.router_backward, student("router_backward", route_backward=route_backward))
    assert says in message and one_sentence(message, "router_backward", "route_backward("), message


def fixed_inputs(s):
    return s[0].shape == (2, 3, 8)  # the checks' fixed inputs: a route right there, wrong elsewhere


INVARIANTS = [  # (a route right on the fixed inputs, the invariant its check names)
    (lambda s, w, g, eps=1e-6: A.route(s, w, g, eps) if fixed_inputs(s) else
     (A.route(s, w, g, eps)[0], 2 * A.route(s, w, g, eps)[1]),
     "its weights do not sum to one over the sources for each token"),
    (lambda s, w, g, eps=1e-6: A.route(s, w, g, eps) if fixed_inputs(s) else
     A.route(s, w + torch.arange(len(w)) * (s[0].mean() > 0), g, eps),
     "reordering the sources does not reorder the weights alike"),
    (lambda s, w, g, eps=1e-6: A.route(s, w, g), "scaling source"),  # eps ignored: 1e-6 hard-coded
    (lambda s, w, g, eps=1e-6: A.route(s, w, g, eps) if w.any() else A.route(s, torch.ones_like(w), g, eps),
     "a zero query w does not give every source the weight 1/n"),
]


@pytest.mark.parametrize("route,says", INVARIANTS, ids=["sum", "permutation", "scale", "zero query"])
def test_each_broken_invariant_is_named(route, says):
    message = verdict(check.router_read, student("router_read", route=route))
    assert "route() breaks an invariant of the formula for random inputs (n=" in message, message
    assert says in message and one_sentence(message, "router_read", "route("), message


def test_the_invariants_hold_for_the_written_out_router_on_random_heads():
    check.properties(check.Student(types.SimpleNamespace(route_heads=lambda s, w, g, h, eps=1e-6: M.route(
        s, w, g, h, eps)), "exercises/multi_head.py"), "route_heads")


def test_a_strict_load_names_the_missing_keys():
    strict = edited("convert", "baseline.state_dict(), strict=False)", "baseline.state_dict())")
    message = verdict(check.zero_init_convert, student("zero_init", convert=strict))
    assert re.search(r"convert\(\) raised RuntimeError( at line \d+)?: load_state_dict\(\) found 8 keys that the "
                     r"routed model has and the baseline lacks \(transformer\.h\.0\.attn_router\.query, "
                     r"\.\.\.\); the routers' are the keys the baseline lacks, so load with strict=False\.$",
                     message), message


# ---------------------------------------------------------------- (c) bad files: one sentence, the rest runs

def nan_route(sources, w, g, eps=1e-6):
    read, alpha = A.route(sources, w, g)
    return read, alpha * float("nan")


BAD = [  # (the student's route, what the sentence says)
    (lambda s, w, g: A.route(s, w, g)[::-1], "returned read of shape (2, 3, 3) for 3 sources; it must be "
                                             "(2, 3, 8)."),
    (lambda s, w, g: (A.route(s, w, g)[0], A.route(s, w, g)[1].unsqueeze(-2)),
     "returned alpha of shape (2, 3, 1, 3) for 3 sources; it must be (2, 3, 3)."),
    (lambda s, w, g: tuple(t.float() for t in A.route(s, w, g)), "returned read in torch.float32 for 3"),
    (nan_route, "returned alpha with NaN or inf in it for 3 sources."),
    (lambda s, w, g: A.route(s, w, g)[0], "returned Tensor for 3 sources; it must return (read, alpha)."),
]


@pytest.mark.parametrize("route,says", BAD)
def test_a_bad_return_is_one_sentence(route, says):
    message = verdict(check.router_read, student("router_read", route=route))
    assert says in message and one_sentence(message, "router_read", "route()"), message


def student_file(tmp_path, text):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "router_read.py").write_text(text)
    return tmp_path / "exercises"


def test_an_error_in_a_function_names_its_line(tmp_path):
    folder = student_file(tmp_path, "def route(sources, w, g, eps=1e-6):\n    return sources[5]\n")
    message = verdict(check.router_read, check.load("router_read", folder))
    assert message == ("exercises/router_read.py: route() raised IndexError at line 2: list index out of "
                       "range.")


def test_a_missing_function_is_one_sentence():
    message = verdict(check.router_read, check.Student(types.SimpleNamespace(), "exercises/router_read.py"))
    assert message == ("exercises/router_read.py has no function route(); keep the name and arguments the "
                       "stub had.")


@pytest.mark.parametrize("text,says", [
    ("import torch\n\ndef route(sources, w, g:\n    pass\n", "does not import: SyntaxError at line 3"),
    ("import torch\nraise RuntimeError('a slip')\n", "does not import: RuntimeError at line 2: a slip."),
    ("route = dict(a=1 b=2)\n", "does not import: SyntaxError at line 1 (invalid syntax)."),
])
def test_a_file_that_does_not_import_is_one_sentence(tmp_path, text, says):
    with pytest.raises(check.Unusable) as e:
        check.load("router_read", student_file(tmp_path, text))
    assert says in str(e.value) and one_sentence(str(e.value), "router_read", "import"), str(e.value)


def solved_copy(tmp_path):
    """A copy of exercises/ whose every file a student writes holds the answers."""
    folder = tmp_path / "exercises"
    shutil.copytree(ROOT / "exercises", folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file, names in FILES.items():
        (folder / f"{file}.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                                           f"from exercise_answers import {', '.join(names)}\n")
    return folder


def pytest_in(folder, *args):
    """`python -m pytest ARGS` beside the folder, as a student runs it: (exit code, what it printed)."""
    command = [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    r = subprocess.run(command, cwd=folder.parent, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return r.returncode, r.stdout + r.stderr


@pytest.mark.slow
def test_one_broken_file_leaves_the_other_checks_running(tmp_path):
    """`python -m pytest exercises` on a copy of the folder, router_read.py broken and every other file the
    answers: one check fails with its one sentence, the six others pass."""
    folder = solved_copy(tmp_path)
    (folder / "router_read.py").write_text("def route(sources, w, g:\n")
    code, said = pytest_in(folder, "exercises")
    assert "exercises/router_read.py does not import: SyntaxError at line 1 (" in said, said
    assert re.search(r"^1 failed, 6 passed in ", said, re.M), said


@pytest.mark.slow
def test_one_exercise_at_a_time(tmp_path):
    """A file named, or -k with a file's name, runs that exercise's checks; a -k that matches none says
    so in one line (exit 4, pytest's usage error) rather than running nothing."""
    folder = solved_copy(tmp_path)
    (folder / "multi_head.py").write_text("def route_heads(sources, w, g, heads, eps=1e-6):\n    raise "
                                          "NotImplementedError\n")
    assert re.search(r"^1 passed in ", pytest_in(folder, "exercises/router_read.py")[1], re.M)
    assert re.search(r"^2 passed in ", pytest_in(folder, "exercises/sources.py")[1], re.M)
    code, said = pytest_in(folder, "exercises", "-k", "multi_head")
    assert code == 1 and re.search(r"^1 failed, 6 deselected in ", said, re.M), said
    assert "exercises/multi_head.py: route_heads() is not written yet" in said
    code, said = pytest_in(folder, "exercises", "-k", "router-read")
    assert code == 4 and "ERROR: -k router-read matches none of the exercises' checks; name one of " \
        "router_read, multi_head, sources, zero_init, router_backward (with underscores), or leave -k out " \
        "to run them all." in said, said


@pytest.mark.slow
def test_the_checks_without_the_environment_say_so_in_one_line(tmp_path):
    """pytest in a Python that lacks torch (a shell without the .venv): one line, no ImportError."""
    folder = solved_copy(tmp_path)
    hide = ("import importlib.util as u, sys, pytest; find = u.find_spec; "
            "u.find_spec = lambda name, *a: None if name == 'torch' else find(name, *a); "
            f"sys.exit(pytest.main([{str(folder)!r}, '-q', '-p', 'no:xdist', '-p', 'no:cacheprovider']))")
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 1 and lines[-1].startswith("error: this Python (") and "lacks delta-gpt's packages " \
        "(torch)" in lines[-1] and "Traceback" not in r.stdout + r.stderr, lines


# ---------------------------------------------------------------- (d) the pages

@pytest.mark.parametrize("file", list(FILES))
def test_an_unwritten_function_says_so(file):
    for fn in check.CHECKS[file]:
        assert verdict(fn, unsolved(file)).endswith("() is not written yet (it raises NotImplementedError); "
                                                    "write it as its docstring says.")


def test_the_pages_show_these_answers_and_the_checks_messages():
    """docs/answers.md's answers are these, each file's functions in one block, and docs/exercises.md
    shows none; the messages exercises.md quotes, the unwritten functions' and a mistake's, are the
    checks'."""
    page, answers = [(ROOT / "docs" / name).read_text() for name in ("exercises.md", "answers.md")]
    shown = re.findall(r"^### [A-E]\. .*?```python\n(.*?)```", answers, re.S | re.M)
    assert shown == ["\n\n".join(inspect.getsource(getattr(A, n)) for n in names) for names in FILES.values()]
    assert "```python" not in page and "<summary>Answer</summary>" not in page
    lines = page.splitlines()
    for file in FILES:
        assert all(verdict(fn, unsolved(file)) in lines for fn in check.CHECKS[file])
    over_tokens = student("router_read", route=edited("route", "softmax(dim=-1)", "softmax(dim=1)"))
    assert verdict(check.router_read, over_tokens) in lines


# ---------------------------------------------------------------- (e) train_mine

def test_train_mine_trains_with_the_students_route(tiny_data, tmp_path, monkeypatch, capsys):
    calls = []

    def route(sources, w, g, eps=1e-6):
        if sources[0].dtype == torch.float32:  # the training's calls (its check before runs in float64)
            calls.append(len(sources))
        return A.route(sources, w, g, eps)

    monkeypatch.setattr(check, "load", lambda name, folder=None: student(name, route=route))
    original = Router.forward
    with pytest.raises(SystemExit) as done:
        train_mine.main(cli_args(tiny_data, tmp_path / "mine", residual="delta"))
    assert done.value.code == 0 and Router.forward is original
    said = capsys.readouterr().out
    assert f"your route() routed every sublayer of this run ({len(calls):,} calls), and routing " in said
    assert re.search(r"routing (moved away from|stayed near) uniform \(mean max weight 0\.\d{3} at step 8, "
                     r"uniform 0\.\d{3}\)", said), said
    assert sorted(set(calls)) == [1, 2, 3, 4]  # delta with 2 layers: its routers read 1, 2, 3 and 4 sources
    assert CK.load_checkpoint(tmp_path / "mine" / "last.pt")["config"]["fast_routing"] is False
    T.train(cfg_for(tiny_data, tmp_path / "plain", residual="delta", fast_routing=False))  # the project's
    mine, plain = train_losses(tmp_path / "mine"), train_losses(tmp_path / "plain")
    assert len(mine) == 8 and [s for s, _ in mine] == [s for s, _ in plain]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(mine, plain))


def test_train_mine_notes_a_wrong_route_and_trains_with_it(tiny_data, tmp_path, monkeypatch, capsys):
    no_gain = edited("route", "keys = g * s", "keys = s")
    monkeypatch.setattr(check, "load", lambda name, folder=None: student(name, route=no_gain))
    with pytest.raises(SystemExit) as done:
        train_mine.main(cli_args(tiny_data, tmp_path / "mine", residual="delta", max_iters=2))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert done.value.code == 0 and (tmp_path / "mine" / "last.pt").exists()
    assert len(notes) == 1 and "the gain g is forgotten" in notes[0]
    assert notes[0].endswith("Training with it anyway.")


def test_train_mine_with_the_unsolved_stub_says_so_in_one_line(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check, "load", lambda name, folder=None: unsolved(name))
    with pytest.raises(SystemExit) as done:
        train_mine.main(cli_args(tiny_data, tmp_path / "mine", residual="delta"))
    assert done.value.code == 1 and not (tmp_path / "mine").exists()
    assert capsys.readouterr().err.splitlines() == [
        "error: exercises/router_read.py: route() is not written yet (it raises NotImplementedError); write "
        "it as its docstring says."]


def test_train_mine_refuses_a_baseline(tiny_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        train_mine.main(cli_args(tiny_data, tmp_path / "mine", residual="baseline"))
    assert done.value.code == 1 and "has no router to run your code" in capsys.readouterr().err


def test_train_mine_refuses_a_route_that_cannot_learn(tiny_data, tmp_path, monkeypatch, capsys):
    """The issue's router: keys and weights under torch.no_grad() pass the values, never learn; with a
    wrong value too (the gain forgotten), the refusal still comes first."""
    def without_gain(sources, w, g, eps=1e-6):
        return keys_under_no_grad(sources, w, torch.ones_like(g), eps)

    for route in (keys_under_no_grad, without_gain):
        monkeypatch.setattr(check, "load", lambda name, folder=None, route=route: student(name, route=route))
        with pytest.raises(SystemExit) as done:
            train_mine.main(cli_args(tiny_data, tmp_path / "mine", residual="delta"))
        err = capsys.readouterr().err.splitlines()
        assert done.value.code == 1 and not (tmp_path / "mine").exists()
        assert len(err) == 1 and err[0].startswith("error: exercises/router_read.py: route() lets no gradient "
                                                   "reach the query w and the gain g"), err


@pytest.mark.slow
def test_train_mine_runs_as_a_script_and_asks_for_the_root(tmp_path):
    """`python exercises/train_mine.py` finds the project's modules; run from exercises/ it says where to
    run it, in one line."""
    def run(*command, cwd):
        return subprocess.run([sys.executable, *command], cwd=cwd, capture_output=True, text=True,
                              timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    r = run("exercises/train_mine.py", "--help", cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("Train with your own router"), r.stderr
    for command in (["train_mine.py"], ["-m", "train_mine"]):
        r = run(*command, "--residual", "delta", cwd=ROOT / "exercises")
        assert r.returncode == 1 and r.stderr.splitlines() == [
            f"error: run it from the repository root ({ROOT}), where data/ and runs/ are: cd {ROOT} && python -m "
            f"exercises.train_mine ..."], r.stderr


def test_sources_cut_from_autograd_are_named():
    detached = edited("write", "partial = v if partial is None else partial + v",
                      "partial = (v if partial is None else partial + v).detach()")
    message = verdict(check.sources_match_stream, student("sources", write=detached))
    assert message == ("exercises/sources.py: write() and sources() give delta (per sublayer) the right "
                       "sources, but the gradient through them does not reach v1, v2, v3, v4, v5, v6 and "
                       "v7 as through the project's Stream: a sum is cut from autograd (.detach(), .data or "
                       "torch.no_grad()); keep every sum in autograd."), message
