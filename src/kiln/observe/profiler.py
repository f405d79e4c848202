"""torch.profiler over a window of optimizer steps, and where those steps spent their time.

The loop marks each step's phases (waiting for data, forward + backward, optimizer) with
``region``; outside the window that is a no-op. On the CPU the phases are host times, and
communication is the time of the collective operations (all-reduce, all-gather, reduce-scatter,
broadcast), taken out of the phases they ran in. On a GPU the host only queues work and runs
ahead of the device, so host times say little, and synchronising at each boundary would idle the
device and hide where it idles by itself: there each boundary records a CUDA event (no wait),
the phases are the device's time between them, communication is the collective kernels' time
(on their own streams, overlapping the phases), and the device's idle time is the step's time
less its kernels'.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kiln.config import ProfileConfig, parse_step_range

PHASES = {
    "kiln/data": "data wait",
    "kiln/rollout": "rollout",
    "kiln/forward_backward": "compute",
    "kiln/optimizer": "optimizer",
}
COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast", "nccl:", "gloo:")


class StepProfiler:
    """Profiles the steps of ``profile.steps`` into ``profile.dir`` (default ``RUN_DIR/profile``),
    each rank of several into its own ``rank-N`` under it (``rank``, None in a single process)."""

    def __init__(
        self, profile: ProfileConfig, run_dir: Path, device: torch.device, *, rank: int | None, console: bool = True
    ):
        self.start, self.end = parse_step_range(profile.steps) if profile.steps else (0, -1)
        out_dir = Path(profile.dir) if profile.dir else run_dir / "profile"
        self.out_dir = out_dir if rank is None else out_dir / f"rank-{rank}"
        self.device = device
        self.on_device = device.type == "cuda"
        self.console = console
        self._prof: torch.profiler.profile | None = None
        self._step_t0 = 0.0
        self.step_times: list[float] = []
        # On a GPU: each step's start and end events, and each region's (name, start, end).
        self._step_events: list[torch.cuda.Event] = []
        self._spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step_begins(self, step: int) -> None:
        """``step`` is 1-based, the step about to run."""
        if step == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
            self._prof.start()
        if self.active:
            if self.on_device:
                self._step_events.append(self._event())
            else:
                self._step_t0 = time.perf_counter()

    def step_ends(self, step: int) -> dict | None:
        """The breakdown, once the window's last step is done."""
        if not self.active:
            return None
        if self.on_device:
            self._step_events.append(self._event())
        else:
            self.step_times.append(time.perf_counter() - self._step_t0)
        if step < self.end:
            return None
        assert self._prof is not None  # active
        if self.on_device:  # the window's one wait for the device: its events are all done
            torch.cuda.synchronize(self.device)
            pairs = zip(self._step_events[::2], self._step_events[1::2], strict=True)
            self.step_times = [start.elapsed_time(end) / 1e3 for start, end in pairs]
        self._prof.stop()
        breakdown = self._write()
        self._prof = None
        return breakdown

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        if not self.active:
            yield
            return
        with torch.profiler.record_function(name):
            if not self.on_device:
                yield
                return
            start = self._event()
            yield
            self._spans.append((name, start, self._event()))

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _write(self) -> dict:
        assert self._prof is not None  # written at the end of the profiled window
        events = self._prof.events()
        steps = len(self.step_times)
        per_step = dict.fromkeys((*PHASES.values(), "communication"), 0.0)
        measured = 1e3 * sum(self.step_times) / steps
        device: dict[str, float] = {}
        if self.on_device:
            for name, start, end in self._spans:
                per_step[PHASES[name]] += start.elapsed_time(end) / steps
            comm, busy = _device_busy_us(events)
            per_step["communication"] = comm / 1e3 / steps  # us -> ms
            busy /= 1e3 * steps
            device = {"device_busy_ms": busy, "device_idle_ms": measured - busy}
        else:
            collectives = _collective_spans(events)
            for e in events:
                if e.name in PHASES:
                    # Collectives run inside the phases; their time is counted once, as communication.
                    comm = _overlap_us(collectives, e.time_range.start, e.time_range.end)
                    per_step[PHASES[e.name]] += (e.cpu_time_total - comm) / 1e3 / steps  # us -> ms
                    per_step["communication"] += comm / 1e3 / steps
        # On a GPU the host only launches: the kernels' own time is what bounds the step there.
        top = sorted(
            (
                e
                for e in self._prof.key_averages()
                if not e.key.startswith("kiln/") and not getattr(e, "is_user_annotation", False)
            ),
            key=lambda e: getattr(e, "self_device_time_total", 0.0) if self.on_device else e.self_cpu_time_total,
            reverse=True,
        )[:10]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"trace-steps-{self.start}-{self.end}.pt.trace.json"
        self._prof.export_chrome_trace(str(trace))
        breakdown = {
            "steps": [self.start, self.end],
            "step_ms": measured,
            "phases_ms": per_step,
            **device,
            "top_operators": [
                {
                    "name": e.key,
                    "self_cpu_ms": e.self_cpu_time_total / 1e3 / steps,
                    "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3 / steps,
                    "calls": e.count / steps,
                }
                for e in top
            ],
            "trace": str(trace),
        }
        (self.out_dir / "breakdown.json").write_text(json.dumps(breakdown, indent=2))
        if self.console:
            print(render(breakdown), flush=True)
        return breakdown


def _collective_spans(events) -> list[tuple[float, float]]:
    """Host-side time spans of collective operations, merged so nested ones count once."""
    return _merged(
        (e.time_range.start, e.time_range.end)
        for e in events
        if any(c in e.name.lower() for c in COLLECTIVES) and e.device_type == torch.autograd.DeviceType.CPU
    )


def _device_busy_us(events) -> tuple[float, float]:
    """Microseconds the device ran collective kernels, and other work (kernels, copies): each the
    union of the work's spans. The device's side of a record_function (an annotation, Inductor's
    "## Call CompiledFxGraph ##" among them) spans idle time as well as kernels: not work."""
    work = [
        e
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    comm = _merged((e.time_range.start, e.time_range.end) for e in work if "nccl" in e.name.lower())
    other = _merged((e.time_range.start, e.time_range.end) for e in work if "nccl" not in e.name.lower())
    return sum(b - a for a, b in comm), sum(b - a for a, b in other)


def _merged(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Time spans, overlapping ones joined."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap_us(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def render(b: dict) -> str:
    start, end = b["steps"]
    step = b["step_ms"]
    lines = [f"kiln profile: steps {start}-{end}, {step:.1f} ms per step", ""]
    phases = b["phases_ms"]
    notes = {
        "data wait": "next batch from the loader, host-to-device copy",
        "rollout": "the job's work on the batch before the step (GRPO's sampling)",
        "compute": "forward + backward",
        "optimizer": "clip, AdamW step, zero_grad",
        "communication": "collectives (all-reduce, all-gather, ...)",
    }
    on_device = "device_busy_ms" in b
    if on_device:  # the collectives' kernels overlap the phases there: not part of their sum
        notes["communication"] = "collective kernels, overlapping the phases"
    for label, ms in phases.items():
        lines.append(f"  {label:<14}{ms:>10.2f} ms {100 * ms / step:>6.1f}%   {notes[label]}")
    covered = sum(ms for label, ms in phases.items() if not (on_device and label == "communication"))
    lines.append(f"  {'other':<14}{step - covered:>10.2f} ms {100 * (step - covered) / step:>6.1f}%   logging, loop")
    if on_device:
        for label, key, note in (
            ("device busy", "device_busy_ms", "the device's kernels (communication aside)"),
            ("device idle", "device_idle_ms", "no kernel running: the device waited for the host"),
        ):
            lines.append(f"  {label:<14}{b[key]:>10.2f} ms {100 * b[key] / step:>6.1f}%   {note}")
    lines += ["", "  top operators by self time per step (device time on a GPU):"]
    for op in b["top_operators"]:
        device = f", device {op['self_device_ms']:.2f} ms" if op["self_device_ms"] else ""
        lines.append(f"    {op['name']:<40}{op['self_cpu_ms']:>9.2f} ms  x{op['calls']:.0f}{device}")
    lines += ["", f"  trace: {b['trace']} (open in https://ui.perfetto.dev, chrome://tracing or TensorBoard)"]
    return "\n".join(lines)
