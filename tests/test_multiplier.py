"""The compute multiplier (workbench/multiplier.py) on a compare.json made here: the steps read off the baseline's
curve of final losses (linear in log steps), the time at the timed speed, and the refusals."""
import json
import math

import pytest

from workbench import multiplier as M


def run(variant, seed, steps, loss, seconds):
    return dict(variant=variant, seed=seed, steps=steps, val_loss=loss, curve=[(steps, loss, seconds)])


def study(tmp_path):
    runs = [run("baseline", 1, 4000, 1.64, 800.0), run("baseline-6000", 1, 6000, 1.57, 1200.0),
            run("baseline-8000", 1, 8000, 1.53, 1600.0), run("attnres-h4", 1, 4000, 1.60, 1000.0),
            run("baseline", 2, 4000, 1.63, 960.0), run("baseline-6000", 2, 6000, 1.55, 1200.0),
            run("baseline-8000", 2, 8000, 1.52, 1600.0), run("attnres-h4", 2, 4000, 1.50, 1000.0)]
    times = {"baseline": [0.20, 0.21], "baseline-6000": [0.20, 0.21], "baseline-8000": [0.20, 0.21],
             "attnres-h4": [0.25, 0.25]}  # timed: 0.80x at the best rounds, the median 0.82x
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(dict(runs=runs, speed=dict(times=times))))
    return path


def test_steps_are_read_off_the_curve_linear_in_log_steps(tmp_path):
    result = json.loads(study(tmp_path).read_text())
    one, two = M.multipliers(result, "attnres-h4", ["baseline", "baseline-6000", "baseline-8000"])
    steps = 4000 * 1.5 ** (0.04 / 0.07)  # between 4000 (1.64) and 6000 (1.57), linear in log(steps)
    assert one["baseline_steps"] == pytest.approx(steps) and one["step_x"] == pytest.approx(steps / 4000)
    assert one["speed"] == pytest.approx(0.82) and one["time_x"] == pytest.approx(steps / 4000 * 0.82)
    assert two["bound"] == "more than " and two["step_x"] == 2.0
    assert math.log(steps) < math.log(4000 + 2000 * 0.04 / 0.07)  # fewer steps than the straight chord


def test_the_table_prints_each_seed(tmp_path, capsys):
    M.main([str(study(tmp_path))])
    out = capsys.readouterr().out
    assert "| 1 | 4000 | 1.6000 | 1.6400, 1.5700, 1.5300 | 5043 | 1.26 | 0.820x | 1.03 |" in out
    assert "| 2 | 4000 | 1.5000 |" in out and "more than 8000 | more than 2.00 |" in out


def test_without_a_timed_speed_it_says_so(tmp_path):
    path = study(tmp_path)
    path.write_text(json.dumps(dict(json.loads(path.read_text()), speed=None)))
    with pytest.raises(SystemExit) as e:
        M.main([str(path)])
    assert "has no timed speed of attnres-h4 and the baseline" in str(e.value) and "\n" not in str(e.value)


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
