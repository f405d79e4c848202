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
    assert set(phases) == {"data wait", "rollout", "compute", "optimizer", "communication"}
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

    # Data that is not there is found once the run starts: the profile's directories go again,
    # while one that was there before stays, with what it held.
    missing = ["--set", f"data.source={tmp_path / 'nothing'}"]
    fresh = tmp_path / "fresh" / "profile"
    bad = in_process("profile", *sets, *missing, "--steps", "2:3", "--out", fresh, check=False)
    assert bad.returncode == 2 and "nothing: no such file or directory" in bad.stderr
    assert not (tmp_path / "fresh").exists()
    bad = in_process("profile", *sets, *missing, "--steps", "2:3", check=False)
    assert bad.returncode == 2
    assert sorted(p.name for p in out.iterdir()) == ["breakdown.json", "trace-steps-2-3.pt.trace.json"]


def test_device_busy_time_is_the_union_of_kernels_not_annotations():
    """The device's side of a record_function (Inductor's "## Call CompiledFxGraph ##" among them)
    spans idle time between kernels: counting it as work put busy time above the step time on a
    GPU. Busy is the union of kernel and copy spans; collective kernels are counted apart."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from kiln.observe.profiler import _device_busy_us

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return FunctionEvent(0, name, 0, start, end, device_type=device, is_user_annotation=annotation)

    events = [
        event("## Call CompiledFxGraph abc ##", 0, 100, annotation=True),
        event("kiln/compute", 0, 120, annotation=True),
        event("triton_poi_fused_add_0", 10, 30),
        event("nvjet_sm90_gemm", 30, 60),
        event("Memcpy HtoD", 50, 70),  # another stream, overlapping the product
        event("ncclDevKernel_AllReduce_Sum_f32", 65, 90),
        event("aten::mm", 0, 200, device=DeviceType.CPU),
    ]
    comm, busy = _device_busy_us(events)
    assert (comm, busy) == (25, 60)
