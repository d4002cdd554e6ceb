"""The exercises in exercises/: the reference answers (tests/exercise_answers.py) pass every check, each
known mistake is named by its check, a bad file gets one sentence and the other exercises still run, the
stubs in the repository stay unsolved, the page shows these answers and the stubs' messages, and train_mine
trains with the student's router. Nothing here writes into exercises/: the checks get the answers as a
namespace, or a copy of the folder."""
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
from exercises import check, train_mine
from plumbing import checkpoint as CK

FILES = {"router_read": ["route"], "multi_head": ["route_heads"], "sources": ["write", "sources"],
         "zero_init": ["init_router_", "convert"], "router_backward": ["route_backward"]}
ANSWERS = [name for names in FILES.values() for name in names]


def student(file, **functions):
    """The answers as the student's file exercises/FILE.py, with `functions` in place of theirs."""
    return check.Student(types.SimpleNamespace(**{**{n: getattr(A, n) for n in ANSWERS}, **functions}),
                         f"exercises/{file}.py")


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
    for a, b in zip(check.route_of(sources, w, g, heads), check.project_route(sources, w, g, heads)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    G = torch.randn(sources[0].shape, dtype=torch.float64)
    mine, ref = check.backward_of(sources, w, g, G), check.project_backward(sources, w, g, G)
    for a, b in zip([*mine[0], *mine[1:]], [*ref[0], *ref[1:]]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_written_out_sources_are_the_streams():
    e, vs = check.pieces()
    for residual, kw, _ in check.MODES:
        config = check.mode_config(residual, kw)
        L = config.n_sublayers // config.n_route_blocks
        mine = check.reads_of(check.right_write, check.right_sources, e, vs, L, config.route_partial,
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


@pytest.mark.slow
def test_one_broken_file_leaves_the_other_checks_running(tmp_path):
    """`python -m pytest exercises` on a copy of the folder, router_read.py broken and every other file the
    answers: one check fails with its one sentence, the six others pass."""
    folder = tmp_path / "exercises"
    shutil.copytree(ROOT / "exercises", folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file, names in FILES.items():
        (folder / f"{file}.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                                           f"from exercise_answers import {', '.join(names)}\n")
    (folder / "router_read.py").write_text("def route(sources, w, g:\n")
    command = [sys.executable, "-m", "pytest", str(folder), "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    r = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    said = r.stdout + r.stderr
    assert "exercises/router_read.py does not import: SyntaxError at line 1 (" in r.stdout, said
    assert re.search(r"^1 failed, 6 passed in ", r.stdout, re.M), said


# ---------------------------------------------------------------- (d) the stubs are unsolved; the page

@pytest.mark.parametrize("file", list(FILES))
def test_the_stubs_in_the_repository_are_unsolved(file):
    stub = check.load(file)
    for name in FILES[file]:
        fn = getattr(stub.module, name)
        needed = [p for p in inspect.signature(fn).parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
        with pytest.raises(NotImplementedError):
            fn(*[None] * len(needed))
    for fn in check.CHECKS[file]:
        assert verdict(fn, stub).endswith("() is not written yet (it raises NotImplementedError); write it "
                                          "as its docstring says.")


def test_the_page_shows_these_answers_and_the_checks_messages():
    """docs/exercises.md's answers are these, each file's functions in one block; the messages it quotes,
    the stubs' and a mistake's, are the checks'."""
    page = (ROOT / "docs" / "exercises.md").read_text()
    shown = re.findall(r"<summary>Answer</summary>\s*```python\n(.*?)```", page, re.S)
    assert shown == ["\n\n".join(inspect.getsource(getattr(A, n)) for n in names) for names in FILES.values()]
    lines = page.splitlines()
    for file in FILES:
        assert all(verdict(fn, check.load(file)) in lines for fn in check.CHECKS[file])
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
    assert f"your route() routed every sublayer of this run ({len(calls):,} calls)" in capsys.readouterr().out
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


def test_train_mine_with_the_unsolved_stub_says_so_in_one_line(tiny_data, tmp_path, capsys):
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
