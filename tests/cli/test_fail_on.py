"""``fail_on=nofit`` (issue 31 item 6): estimate and plan exit 1 when nothing fits, printing the
answer all the same; without it any answer is exit 0; another value is one line, exit 2."""

from __future__ import annotations

from conftest import harness_cli

OVER = ("model=llama3_70b", "device=h100_80gb")  # one GPU: 70B does not fit


def test_nothing_fits_is_exit_1_only_when_asked():
    for command in (
        ("estimate", *OVER),
        ("plan", *OVER, "plan.gpus=1"),
        ("plan", *OVER, "plan.solve=min_gpus", "plan.max_gpus=4"),
    ):
        asked = harness_cli(*command, "fail_on=nofit")
        assert asked.returncode == 1, (command, asked.stderr)
        assert asked.stdout.strip(), "the answer is printed all the same"
        assert harness_cli(*command).returncode == 0


def test_something_fits_is_exit_0():
    assert harness_cli("estimate", "model=tiny", "fail_on=nofit").returncode == 0
    assert (
        harness_cli("plan", "model=llama3_8b", "device=h100_80gb", "plan.gpus=8", "fail_on=nofit").returncode
        == 0
    )


def test_another_value_is_a_usage_error():
    done = harness_cli("estimate", "model=tiny", "fail_on=oom")
    assert done.returncode == 2
    assert (
        done.stderr.strip().splitlines()[-1] == "harness estimate: error: fail_on='oom' must be nofit or null"
    )
