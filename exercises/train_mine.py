"""Train with your own router: `python -m exercises.train_mine --residual delta --max-iters 300`
(any option of `python cli.py train`), from the repository root. Every dynamic router then reads its
sources with your route() (exercises/router_read.py), or with --route-heads H > 1 your route_heads()
(exercises/multi_head.py), in place of delta_gpt's Router.forward, on the readable path
(--no-fast-routing: the fast path never calls Router.forward); the rest is `python cli.py train`."""
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python exercises/train_mine.py` puts exercises/ first, not ROOT
    sys.path.insert(0, str(ROOT))

from errors import check_packages  # noqa: E402

check_packages()  # one line in a shell without the .venv

import torch  # noqa: E402

import cli  # noqa: E402
import train as T  # noqa: E402
from delta_gpt import Router, upcast  # noqa: E402
from errors import ConfigError, DeltaGPTError  # noqa: E402
from exercises import check  # noqa: E402
from plumbing import rundir as RD  # noqa: E402
from plumbing.config import out_dir_of  # noqa: E402


def load_router(heads):
    """Your route (heads == 1) or route_heads, checked first: an unusable file or a router that
    cannot learn stops here, a wrong one gets a note."""
    name, fn, check_fn = ("router_read", "route", check.router_read) if heads == 1 else \
        ("multi_head", "route_heads", check.multi_head)
    student = check.load(name)
    try:
        check_fn(student)
    except check.Unusable:
        raise
    except check.Wrong as e:
        check.flowing(student, fn, 1 if heads == 1 else 2)  # a wrong router trains, a blocked not
        print(f"note: {e} Training with it anyway.", file=sys.stderr)
    return student, fn


def routing_moved(out_dir):
    """A clause saying whether the last evaluation's routing moved away from uniform ('' without
    one)."""
    evals = [r for r in RD.read_metrics(out_dir) if r["kind"] == "eval" and r.get("routing")]
    multi = [r["uniform"] for r in evals[-1]["routing"]["sublayers"] if r["n"] > 1] if evals else []
    if not multi:
        return ""
    step, got = evals[-1]["step"], evals[-1]["routing"]["mean_max_weight"]
    uniform = sum(multi) / len(multi)
    said = f"(mean max weight {got:.3f} at step {step}, uniform {uniform:.3f})"
    if got - uniform > 0.005:  # the figure train prints at each evaluation, to its last digits
        return f", and routing moved away from uniform {said}"
    return f", and routing stayed near uniform {said}: the queries hardly learned"


@contextmanager
def routed_by(student, fn):
    """Router.forward replaced by your function; yields the count of its calls, and restores
    Router.forward at the end."""
    original, calls = Router.forward, [0]

    def forward(self, sources):
        calls[0] += 1
        # float32 (or float64), as Router.forward
        with torch.autocast(sources[0].device.type, enabled=False):
            s, w, g = [upcast(x) for x in sources], upcast(self.query), upcast(self.norm.weight)
            args = (s, w, g) if self.heads == 1 else (s, w, g, self.heads)
            read, alpha = student(fn, *args)
        return read.to(sources[0].dtype), check.heads_first(fn, alpha)

    Router.forward = forward
    try:
        yield calls
    finally:
        Router.forward = original


def main(argv=None):
    """Check your router, then `cli.py train ARGV --no-fast-routing` with it; bad input: one line,
    exit 1."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return
    try:
        if Path.cwd().resolve() != ROOT:
            raise ConfigError(f"run it from the repository root ({ROOT}), where data/ and runs/ "
                              f"are: cd {ROOT} && python -m exercises.train_mine ...")
        cfg = T.config_from_args(argv)
        if cfg.residual == "baseline":
            raise ConfigError("--residual baseline has no router to run your code; choose attnres, "
                              "delta or delta_block")
        if cfg.route_weights == "static":
            raise ConfigError("--route-weights static has no query for your router; leave it out "
                              "(dynamic routing)")
        student, fn = load_router(cfg.route_heads or 1)
    except (DeltaGPTError, check.Wrong) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    with routed_by(student, fn) as calls:
        try:
            cli.app(["train", *argv, "--no-fast-routing"],
                    prog_name="python -m exercises.train_mine")
            code = 0
        except SystemExit as e:
            code = e.code
        except check.Wrong as e:  # your function failed on the training's inputs
            print(f"error: {e}", file=sys.stderr)
            code = 1
    if code == 0:
        print(f"{student.file}: your {fn}() routed every sublayer of this run ({calls[0]:,} calls)"
              f"{routing_moved(out_dir_of(cfg))}")
    sys.exit(code)


if __name__ == "__main__":
    main()
