"""The compute multiplier (workbench/multiplier.py) on a compare.json made here: the steps read off the baseline's
curve of final losses, the time at the baseline's median time per step, and the refusals."""
import json

import pytest

from workbench import multiplier as M


def run(variant, seed, steps, loss, seconds):
    return dict(variant=variant, seed=seed, steps=steps, val_loss=loss, curve=[(steps, loss, seconds)])


def study(tmp_path):
    runs = [run("baseline", 1, 4000, 1.64, 800.0), run("baseline-6000", 1, 6000, 1.57, 1200.0),
            run("baseline-8000", 1, 8000, 1.53, 1600.0), run("attnres-h4", 1, 4000, 1.60, 1000.0),
            run("baseline", 2, 4000, 1.63, 960.0), run("baseline-6000", 2, 6000, 1.55, 1200.0),
            run("baseline-8000", 2, 8000, 1.52, 1600.0), run("attnres-h4", 2, 4000, 1.50, 1000.0)]
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(dict(runs=runs)))
    return path


def test_steps_are_read_off_the_curve_between_the_bracketing_lengths():
    curve = [(8000, 1.53), (4000, 1.64), (6000, 1.57)]
    assert M.steps_to_reach(1.60, curve) == (pytest.approx(4000 + 2000 * 0.04 / 0.07), "")
    assert M.steps_to_reach(1.70, curve) == (4000, "less than ")
    assert M.steps_to_reach(1.50, curve) == (8000, "more than ")


def test_the_time_is_at_the_baselines_median_time_per_step(tmp_path):
    result = json.loads(study(tmp_path).read_text())
    one, two = M.multipliers(result, "attnres-h4", ["baseline", "baseline-6000", "baseline-8000"])
    steps = 4000 + 2000 * 0.04 / 0.07
    assert one["step_x"] == pytest.approx(steps / 4000)
    assert one["time_x"] == pytest.approx(steps * 0.2 / 1000)  # 0.2 s per step: the median, not the mean
    assert two["bound"] == "more than " and two["step_x"] == 2.0


def test_the_table_prints_each_seed(tmp_path, capsys):
    M.main([str(study(tmp_path))])
    out = capsys.readouterr().out
    assert "| 1 | 4000 | 1.6000 | 1.6400, 1.5700, 1.5300 | 5143 | 1.29 | 1.03 |" in out
    assert "| 2 | 4000 | 1.5000 |" in out and "more than 8000 | more than 2.00 |" in out


@pytest.mark.parametrize("argv, words", [
    (["--variant", "delta"], "no runs of delta"),
    (["--baselines", "baseline,baseline-9000"], "no runs of baseline-9000"),
])
def test_refusals_name_what_is_missing(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        M.main([str(study(tmp_path)), *argv])
    assert words in str(e.value) and "its variants are" in str(e.value)


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        M.main([str(tmp_path / "none.json")])
    assert str(e.value).startswith("error: cannot read") and "\n" not in str(e.value)
