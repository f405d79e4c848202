"""torch.profiler over a window of steps: a trace a viewer can open, and a breakdown that adds up."""

import json

import pytest

from kiln.config import ConfigError, load_config

from conftest import token_sequences, train_tiny_gpt

pytestmark = pytest.mark.e2e


def test_profile_window_writes_trace_and_breakdown(tmp_path, capsys):
    data = token_sequences(tmp_path)
    train_tiny_gpt(tmp_path / "run", data, micro=4, global_=16, steps=7, **{"profile.steps": "3:6"})
    out = tmp_path / "run" / "profile"
    breakdown = json.loads((out / "breakdown.json").read_text())
    assert breakdown["steps"] == [3, 6]
    phases = breakdown["phases_ms"]
    assert set(phases) == {"data wait", "compute", "optimizer", "communication"}
    assert phases["compute"] > phases["optimizer"] > 0
    # The phases, measured from the profiler's events, account for the step time measured around
    # each step by the clock.
    assert sum(phases.values()) == pytest.approx(breakdown["step_ms"], rel=0.10)
    assert breakdown["top_operators"] and all(op["self_cpu_ms"] >= 0 for op in breakdown["top_operators"])
    trace = json.loads((out / "trace-steps-3-6.pt.trace.json").read_text())  # Chrome/Perfetto trace format
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"kiln/forward_backward", "kiln/optimizer", "kiln/data"} <= names


def test_bad_step_range_is_named():
    with pytest.raises(ConfigError, match="profile.steps: '0:3' is not a step range"):
        load_config(None, ["profile.steps=0:3"])


def test_kiln_profile_keeps_only_the_profile(tmp_path, corpus_dir):
    from conftest import tiny_overrides
    from kilnrun import in_process

    sets = [a for i in tiny_overrides(tmp_path / "run", corpus_dir) for a in ("--set", i)]
    proc = in_process("profile", *sets, "--steps", "2:3")
    assert "kiln profile: steps 2-3" in proc.stdout and "top operators" in proc.stdout
    out = tmp_path / "run" / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["breakdown.json", "trace-steps-2-3.pt.trace.json"]
    bad = in_process("profile", *sets, "--steps", "4:2", check=False)
    assert bad.returncode == 2 and "--steps: '4:2' is not a step range" in bad.stderr
