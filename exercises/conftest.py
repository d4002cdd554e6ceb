"""The exercises' checks under pytest: each file a student writes, exercises/NAME.py, is collected
as its checks (exercises/check.py), so that `pytest exercises`, `pytest exercises/router_read.py`
and `pytest exercises -k router_read` each run what they name, and a failure prints its one
sentence."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: delta_gpt, errors, exercises

from errors import check_packages  # noqa: E402

check_packages(("torch", "numpy"))  # one line in a shell without the .venv, not an ImportError

import pytest  # noqa: E402
import torch  # noqa: E402

from exercises import check  # noqa: E402

torch.set_num_threads(1)  # the checks are small, and a shared machine's other cores are busy


class Check(pytest.Item):
    """One check of exercise file NAME.py, run on that file imported afresh."""

    def __init__(self, *, fn, **kw):
        super().__init__(**kw)
        self.fn = fn

    def runtest(self):
        self.fn(check.load(self.path.stem, self.path.parent))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, check.Wrong):
            return str(excinfo.value)  # the one sentence, no traceback into the checks
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::{self.name}"


class Exercise(pytest.File):
    def collect(self):
        for fn in check.CHECKS[self.path.stem]:
            yield Check.from_parent(self, name=fn.__name__, fn=fn)


def is_exercise(path):
    return path.parent == HERE and path.suffix == ".py" and path.stem in check.CHECKS


def pytest_collect_file(file_path, parent):
    # a file named on the command line reaches pytest_pycollect_makemodule instead
    if is_exercise(file_path) and not parent.session.isinitpath(file_path):
        return Exercise.from_parent(parent, path=file_path)


def pytest_pycollect_makemodule(module_path, parent):
    # `pytest exercises/router_read.py`: its checks, not the student's file as a test module
    if is_exercise(module_path):
        return Exercise.from_parent(parent, path=module_path)


def pytest_collection_modifyitems(items):
    # the page's order (A to E), not the files' alphabetical one
    order = [fn for fns in check.CHECKS.values() for fn in fns]
    items.sort(key=lambda item: order.index(item.fn) if isinstance(item, Check) else -1)


def pytest_collection_finish(session):
    keyword = session.config.option.keyword
    if keyword and not session.items:  # -k deselected every check: say so rather than run nothing
        raise pytest.UsageError(f"-k {keyword} matches none of the exercises' checks; name one of "
                                f"{', '.join(check.CHECKS)} (with underscores), or leave -k out to "
                                "run them all.")
