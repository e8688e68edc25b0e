"""Every numeric option of ``torchani-fast`` at and beyond its bounds: one
validator (``cli._option_errors``) refuses a bad value before any work with a
one-line error naming the option and the value (exit status 2), and accepts
every value inside the bounds.

Before issue 60: ``md --seed -1`` printed an 18-line traceback (numpy's
``default_rng``); ``--workers 0`` silently ran locally, and ``--resume`` with it
then said "needs --workers" (exit 1, after reading the inputs).
"""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchani_fast import cli

INPUT = "in.xyz"  # never read: the options are checked first

# (command, option, bad values, good values at the bounds, the message's start)
BOUNDS = [
    ("energy", "--batch-size", ["0", "-3"], ["1", "100000"], "--batch-size must be at least 1"),
    ("energy", "--workers", ["0", "-1"], ["1"], "--workers must be at least 1"),
    ("optimize", "--workers", ["0"], ["1"], "--workers must be at least 1"),
    ("optimize", "--steps", ["0", "-1"], ["1"], "--steps must be at least 1"),
    ("optimize", "--fmax", ["0", "-0.1", "nan", "inf"], ["1e-12", "10"], "--fmax must be a finite number > 0"),
    ("md", "--steps", ["0"], ["1"], "--steps must be at least 1"),
    ("md", "--interval", ["0", "-5"], ["1"], "--interval must be at least 1"),
    ("md", "--dt", ["0", "-0.5", "10.001", "nan", "inf"], ["1e-6", "10"], "--dt must be in (0, 10] fs"),
    ("md", "--temperature", ["-1", "nan", "inf"], ["0", "100000"], "--temperature must be a finite number >= 0"),
    ("md", "--temperature", ["100001"], [], "--temperature 100001.0 K is far beyond"),
    ("md", "--friction", ["-0.01", "nan", "inf"], ["0", "1"], "--friction must be a finite number >= 0"),
    ("md", "--seed", ["-1", "-99999999999"], ["0", str(2 ** 64)], "--seed must be an integer >= 0"),
]
CASES_BAD = [(c, o, v, m) for c, o, bad, _, m in BOUNDS for v in bad]
CASES_GOOD = [(c, o, v) for c, o, _, good, _ in BOUNDS for v in good]


def _argv(command, option, value):
    return [command, INPUT, f"{option}={value}"]


@pytest.mark.parametrize("command, option, value, message", CASES_BAD)
def test_bad_value_is_one_line_naming_option_and_value_exit_2(capsys, command, option, value, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(_argv(command, option, value))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage:")  # argparse's usage, then the error
    assert lines[1].startswith("torchani-fast: error: ") and message in lines[1]
    shown = lines[1].split("got ")[-1] if "got " in lines[1] else lines[1]
    assert str(float(value)) in shown or value in shown


@pytest.mark.parametrize("command, option, value", CASES_GOOD)
def test_values_at_the_bounds_are_accepted(command, option, value):
    args = cli.build_parser().parse_args(_argv(command, option, value))
    assert cli._option_errors(args) == []


def test_resume_without_a_cluster_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["energy", INPUT, "-o", "out.json", "--resume"])
    assert exc.value.code == 2
    assert "--resume needs --scheduler or --workers" in capsys.readouterr().err


def test_resume_with_zero_workers_names_workers(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["energy", INPUT, "-o", "out.json", "--resume", "--workers", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--workers must be at least 1, got 0" in err


INT_OPTIONS = [("energy", "--batch-size", 1), ("energy", "--workers", 1), ("optimize", "--steps", 1),
               ("md", "--steps", 1), ("md", "--interval", 1), ("md", "--seed", 0)]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(INT_OPTIONS), value=st.integers(-2 ** 70, 2 ** 70))
def test_integer_options_refused_exactly_below_their_bound(case, value):
    command, option, low = case
    errors = cli._option_errors(cli.build_parser().parse_args(_argv(command, option, value)))
    assert bool(errors) == (value < low)
    if errors:
        assert errors[0].startswith(option) and str(value) in errors[0]


FLOAT_OPTIONS = [("optimize", "--fmax", lambda x: math.isfinite(x) and x > 0),
                 ("md", "--dt", lambda x: math.isfinite(x) and 0 < x <= 10),
                 ("md", "--temperature", lambda x: math.isfinite(x) and 0 <= x <= 1e5),
                 ("md", "--friction", lambda x: math.isfinite(x) and x >= 0)]


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(FLOAT_OPTIONS), value=st.floats(allow_nan=True, allow_infinity=True))
def test_float_options_refused_exactly_outside_their_range(case, value):
    command, option, valid = case
    errors = cli._option_errors(cli.build_parser().parse_args(_argv(command, option, repr(value))))
    assert bool(errors) == (not valid(value))
    if errors:
        assert errors[0].startswith(option)
