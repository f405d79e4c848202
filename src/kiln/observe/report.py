"""``kiln report``: a run's curves in one PNG and its numbers in a short text summary; for a
mixture of experts, a second PNG: the heat map of its experts' load; for a run that logged
benchmark task scores (``tasks/<task>/<metric>``), one more panel of them over the steps. Given
several runs, a comparison table of their final numbers instead.

Everything comes from the run directory (``metrics.jsonl``, and ``env.json`` when present), so a
finished, running or interrupted run can be reported from any machine that has its directory.
"""

from __future__ import annotations

import io
import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.checkpoint import CheckpointError
from kiln.config import ConfigError
from kiln.io import write_atomic
from kiln.observe.metrics import METRICS_FILE, format_duration

REPORT_PNG = "report.png"
# What --out may end in; the figure is written in the format its name says.
FIGURE_FORMATS = ("png", "svg", "pdf")
MEMORY_PREFIX = "memory/"
EVENT_COLORS = ["tab:red", "tab:gray", "tab:olive", "tab:pink"]
MOE_LOAD = "moe/load"
SOURCE_TOKENS = "data/tokens/"
# Benchmark task scores, ``tasks/<task>/<metric>`` (lm-eval's metric names: ``acc``, ``acc_norm``,
# ``bits_per_byte``...); ``<metric>_stderr`` is the standard error of ``<metric>``.
TASKS_PREFIX = "tasks/"
STDERR = "_stderr"
# How many task metrics the figure's summary panel lists (all are in the text and the table).
PANEL_TASKS = 6


# -- reading the run ----------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``, in file order. A run killed mid-write can leave a torn
    last line; it is skipped rather than failing the whole report."""
    if not run_dir.exists():
        raise CheckpointError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: not a directory (kiln report takes a run directory)")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: not a kiln run directory (missing {METRICS_FILE})")
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):
                raise CheckpointError(f"{path}:{number}: not a JSON record") from None
    if not any("loss" in r for r in records):
        raise CheckpointError(f"{path}: no training steps logged yet; nothing to report")
    return records


def _read_env(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "env.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _segments(train: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The training records split per ``kiln train`` invocation: ``elapsed_s`` restarts from
    zero when a run resumes, so a drop marks the start of a new one."""
    segments: list[list[dict[str, Any]]] = []
    previous = math.inf
    for record in train:
        elapsed = record.get("elapsed_s", 0.0)
        if not segments or elapsed < previous:
            segments.append([])
        segments[-1].append(record)
        previous = elapsed
    return segments


# -- the numbers ----------------------------------------------------------------------------------


def _memory_name(key: str) -> str:
    """``memory/peak_allocated_gib`` -> ``peak_allocated`` (the summary says GiB once)."""
    return key[len(MEMORY_PREFIX) :].removesuffix("_gib")


def _finite(values: list[Any]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _last(records: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in records if key in r]
    return values[-1] if values else None


def _best(records: list[dict[str, Any]], key: str, higher: bool = False) -> float | None:
    values = _finite([r[key] for r in records if key in r])
    return (max if higher else min)(values) if values else None


def _is_task_key(key: str) -> bool:
    return key.startswith(TASKS_PREFIX)


def _is_stderr(name: str) -> bool:
    """Whether ``name`` is a standard error (``hellaswag/acc_stderr``; lm-eval's filtered
    ``gsm8k/exact_match_stderr,strict-match``), not a metric of its own."""
    return name.rpartition("/")[2].partition(",")[0].endswith(STDERR)


def _stderr_name(name: str) -> str:
    """``hellaswag/acc`` -> ``hellaswag/acc_stderr``; ``gsm8k/exact_match,strict-match`` ->
    ``gsm8k/exact_match_stderr,strict-match``."""
    task, _, metric = name.rpartition("/")
    head, comma, tail = metric.partition(",")
    return f"{task}/{head}{STDERR}{comma}{tail}"


def split_records(records: list[dict[str, Any]]) -> tuple[list, list, list]:
    """(training, evaluation, event) records: events have an ``event`` key, training records a
    ``loss``, evaluations a ``val_loss`` or ``val_bpb`` (both are logged at the same step) or
    benchmark task scores (``tasks/<task>/<metric>``, alone or with the validation loss)."""
    events = [r for r in records if "event" in r]
    train = [r for r in records if "loss" in r and "event" not in r]
    evals = [
        r for r in records if "event" not in r and ("val_loss" in r or "val_bpb" in r or any(map(_is_task_key, r)))
    ]
    return train, evals, events


def _natural(name: str) -> list[Any]:
    """A sort key that puts ``mmlu_2`` before ``mmlu_10``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def task_scores(evals: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each task metric's last logged value, keyed ``<task>/<metric>`` in name order: ``last``,
    the ``step`` it was measured at, its ``stderr`` where logged with it (else None) and the
    number of ``points``. A standard error is not a metric of its own."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in evals:
        for key, value in r.items():
            if _is_task_key(key) and isinstance(value, (int, float)) and isinstance(r.get("step"), int):
                series.setdefault(key[len(TASKS_PREFIX) :], []).append((r["step"], value))
    scores = {}
    for name in sorted((n for n in series if not _is_stderr(n)), key=_natural):
        step, last = series[name][-1]
        # The standard error measured with the last value, not an older one.
        stderr = [v for s, v in series.get(_stderr_name(name), []) if s == step]
        scores[name] = {
            "last": last,
            "step": step,
            "stderr": stderr[-1] if stderr else None,
            "points": len(series[name]),
        }
    return scores


def summarize(records: list[dict[str, Any]], env: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's numbers. A number the run did not log is None; a non-finite loss is kept where
    it is first or last (it says the run diverged), and left out of the minimum."""
    env = env or {}
    train, evals, events = split_records(records)
    segments = _segments(train)
    losses = [r["loss"] for r in train]
    finite_losses = _finite(losses)
    # The first interval of each invocation includes start-up (compiling, allocator warm-up).
    steady = [r["tokens_per_s"] for seg in segments for r in seg[1:] if "tokens_per_s" in r]
    if not steady:
        steady = [r["tokens_per_s"] for r in train if "tokens_per_s" in r]
    steady = _finite(steady)
    memory_keys = sorted({k for r in train for k in r if k.startswith(MEMORY_PREFIX)})
    load = _last(train, MOE_LOAD)
    return {
        "parameters": env.get("parameters"),
        "device": env.get("device_name") or env.get("device"),
        "steps": train[-1]["step"],
        "tokens": _last(train, "tokens"),
        "global_batch": _last(train, "global_batch"),
        "wall_time_s": sum(seg[-1].get("elapsed_s", 0.0) for seg in segments),
        "invocations": len(segments),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_min": min(finite_losses) if finite_losses else None,
        "nonfinite_losses": len(losses) - len(finite_losses),
        "val_loss_last": _last(evals, "val_loss"),
        "val_loss_best": _best(evals, "val_loss"),
        "val_bpb_last": _last(evals, "val_bpb"),
        "val_bpb_best": _best(evals, "val_bpb"),
        # A classifier's figures, where it logged them (higher is better).
        "val_accuracy_last": _last(evals, "val_accuracy"),
        "val_accuracy_best": _best(evals, "val_accuracy", higher=True),
        "val_macro_f1_last": _last(evals, "val_macro_f1"),
        "val_macro_f1_best": _best(evals, "val_macro_f1", higher=True),
        # A preference objective's rewards (TRL's names), where the run logged them.
        "rewards_accuracy_last": _last(train, "rewards/accuracies"),
        "rewards_margin_last": _last(train, "rewards/margins"),
        "val_rewards_accuracy_last": _last(evals, "val_rewards/accuracies"),
        "val_rewards_margin_last": _last(evals, "val_rewards/margins"),
        "tokens_per_s_mean": sum(steady) / len(steady) if steady else None,
        "peak_memory_gib": {
            _memory_name(k): max(_finite([r[k] for r in train if k in r]), default=None) for k in memory_keys
        },
        "events": dict(Counter(r["event"] for r in events)),
        # A mixture of experts' routing, where the run logged it.
        "moe_layers": len(load) if load else None,
        "moe_experts": max(map(len, load.values())) if load else None,
        "moe_imbalance_last": _last(train, "moe/imbalance"),
        "moe_imbalance_max": _best(train, "moe/imbalance", higher=True),
        "moe_min_load_last": _last(train, "moe/min_load"),
        "moe_router_entropy_last": _last(train, "moe/router_entropy"),
        # An interval that dropped nothing logs no ``moe/dropped``: its last value may be stale.
        "moe_dropped_max": _best(train, "moe/dropped", higher=True),
        # Benchmark task scores, where the run logged them: the last value of each metric.
        "tasks": task_scores(evals),
        # A data mixture's sources: tokens and epochs drawn, and the last validation of each.
        "sources": {
            name: {
                "tokens": _last(train, f"data/tokens/{name}"),
                "epochs": _last(train, f"data/epochs/{name}"),
                "val_loss_last": _last(evals, f"val_loss/{name}"),
                "val_bpb_last": _last(evals, f"val_bpb/{name}"),
            }
            for name in sorted({k.removeprefix(SOURCE_TOKENS) for r in train for k in r if k.startswith(SOURCE_TOKENS)})
        },
    }


# -- the text -------------------------------------------------------------------------------------


def _num(value: Any, fmt: str = ".4g") -> str:
    if value is None:
        return "-"
    return format(value, fmt) if isinstance(value, float) else f"{value:,}"


def _task_value(score: dict[str, Any]) -> str:
    """``0.3125 ± 0.0146``, or the value alone where no standard error was logged."""
    stderr = f" ± {_num(score['stderr'], '.3g')}" if score["stderr"] is not None else ""
    return f"{_num(score['last'])}{stderr}"


def _count(n: float) -> str:
    """1,377,408 -> '1.38M': parameter and token counts at a glance."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def headline(s: dict[str, Any]) -> str:
    """One line of key facts, for the figure title and the top of the text."""
    facts = [
        f"{_count(s['parameters'])} parameters" if s["parameters"] else None,
        s["device"],
        f"{s['steps']:,} steps",
        f"{_count(s['tokens'])} tokens" if s["tokens"] else None,
        format_duration(s["wall_time_s"]),
    ]
    return " | ".join(f for f in facts if f)


def format_summary(run_dir: Path, s: dict[str, Any]) -> str:
    lines = [f"run          {run_dir}", f"             {headline(s)}"]
    tokens = f"{s['tokens']:,} tokens" if s["tokens"] is not None else "tokens not logged"
    batch = f", global batch {s['global_batch']}" if s["global_batch"] is not None else ""
    lines.append(f"steps        {s['steps']:,} ({tokens}{batch})")
    runs = f" over {s['invocations']} invocations (resumed)" if s["invocations"] > 1 else ""
    lines.append(f"wall time    {format_duration(s['wall_time_s'])}{runs}")
    bad = f"  ({s['nonfinite_losses']} non-finite)" if s["nonfinite_losses"] else ""
    lines.append(
        f"train loss   first {_num(s['loss_first'])}  last {_num(s['loss_last'])}  min {_num(s['loss_min'])}{bad}"
    )
    if s["val_loss_last"] is not None:
        lines.append(f"val loss     last {_num(s['val_loss_last'])}  best {_num(s['val_loss_best'])}")
    if s["val_bpb_last"] is not None:
        lines.append(f"val bpb      last {_num(s['val_bpb_last'])}  best {_num(s['val_bpb_best'])}")
    if s["val_accuracy_last"] is not None:
        lines.append(f"val accuracy last {_num(s['val_accuracy_last'])}  best {_num(s['val_accuracy_best'])}")
        lines.append(f"val macro-F1 last {_num(s['val_macro_f1_last'])}  best {_num(s['val_macro_f1_best'])}")
    if s["rewards_accuracy_last"] is not None:
        val = ""
        if s["val_rewards_accuracy_last"] is not None:
            val = f"  val {_num(s['val_rewards_accuracy_last'])} (margin {_num(s['val_rewards_margin_last'])})"
        lines.append(
            f"rewards      accuracy last {_num(s['rewards_accuracy_last'])}"
            f" (margin {_num(s['rewards_margin_last'])}){val}"
        )
    width = max(map(len, s["tasks"]), default=0)
    for i, (name, score) in enumerate(s["tasks"].items()):
        lines.append(f"{'tasks' if i == 0 else '':<13}{name:<{width}}  {_task_value(score)}  (step {score['step']:,})")
    if s["tokens_per_s_mean"] is not None:
        lines.append(f"tokens/s     {s['tokens_per_s_mean']:,.0f} mean (first interval of each invocation left out)")
    if s["peak_memory_gib"]:
        peaks = "  ".join(f"{k} {_num(v, '.2f')} GiB" for k, v in s["peak_memory_gib"].items())
        lines.append(f"peak memory  {peaks}")
    if s["moe_layers"] is not None:
        lines.append(
            f"experts      {s['moe_layers']} layers x {s['moe_experts']}:"
            f" imbalance last {_num(s['moe_imbalance_last'])}  max {_num(s['moe_imbalance_max'])}"
            f"  min load last {_num(s['moe_min_load_last'])}"
        )
        dropped = f"  dropped max {_num(s['moe_dropped_max'], '.2%')}" if s["moe_dropped_max"] is not None else ""
        lines.append(
            f"router       entropy last {_num(s['moe_router_entropy_last'])} nats"
            f" (at most ln {s['moe_experts']} = {math.log(s['moe_experts']):.4g}){dropped}"
        )
    for name, use in s["sources"].items():
        drawn = sum(u["tokens"] or 0 for u in s["sources"].values())
        share = f" ({use['tokens'] / drawn:.1%})" if drawn and use["tokens"] is not None else ""
        val = f"  val loss last {_num(use['val_loss_last'])}" if use["val_loss_last"] is not None else ""
        epochs = _num(use["epochs"], ".3g")
        lines.append(f"source {name:<6}{_count(use['tokens'] or 0)} tokens{share}, {epochs} epochs{val}")
    events = ", ".join(f"{kind} x{n}" for kind, n in sorted(s["events"].items())) or "none"
    lines.append(f"events       {events}")
    return "\n".join(lines) + "\n"


# -- the figure -----------------------------------------------------------------------------------


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key``; non-finite values become NaN, which matplotlib leaves as a
    gap instead of stretching the axis to infinity."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v if math.isfinite(v) else math.nan for _, v in points]


def _line(ax, records: list[dict[str, Any]], key: str, **style) -> None:
    steps, values = _series(records, key)
    # Dots on short series: a point between two non-finite ones has no line to show it.
    ax.plot(steps, values, marker="." if len(steps) <= 40 else None, lw=1.2, **style)


def _panel(ax, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=12, loc="left", fontweight="bold")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _plot_loss(ax, train, evals, events) -> None:
    _line(ax, train, "loss", color="tab:blue", label="train loss")
    if any("val_loss" in r for r in evals):
        ax.plot(*_series(evals, "val_loss"), "o-", color="tab:orange", ms=4, lw=1.2, label="val loss")
    bad = [r["step"] for r in train if not _finite([r["loss"]])]
    if bad:
        ax.plot(
            bad,
            [0] * len(bad),
            "x",
            color="tab:red",
            ms=7,
            transform=ax.get_xaxis_transform(),
            label="non-finite loss",
            clip_on=False,
        )
    kinds = sorted({e["event"] for e in events})
    for e in events:
        ax.axvline(e["step"], color=EVENT_COLORS[kinds.index(e["event"]) % len(EVENT_COLORS)], ls=":", lw=1.2)
    for i, kind in enumerate(kinds):  # one legend entry per kind, however many events
        ax.plot([], [], color=EVENT_COLORS[i % len(EVENT_COLORS)], ls=":", label=f"event: {kind}")
    _panel(ax, "Loss", "loss (nats/token)")
    ax.legend(fontsize=9)


def _plot_lr(ax, train) -> None:
    from matplotlib.ticker import FormatStrFormatter

    _line(ax, train, "lr", color="tab:green")
    # Plain tick labels: the default scientific offset ("1e-3") lands on the panel title.
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    _panel(ax, "Learning rate", "lr")


def _plot_throughput(ax, train, mean: float | None) -> None:
    _line(ax, train, "tokens_per_s", color="tab:cyan", label="tokens/s")
    if mean is not None:
        ax.axhline(mean, color="gray", ls="--", lw=1, label=f"mean {mean:,.0f} (after warm-up)")
    ax.set_ylim(bottom=0)
    _panel(ax, "Throughput", "tokens / s")
    ax.legend(fontsize=9, loc="lower right")


def _plot_grad_norm(ax, train) -> None:
    _line(ax, train, "grad_norm", color="tab:purple")
    finite = [v for v in _series(train, "grad_norm")[1] if v > 0]
    # A few spikes hide the steady level on a linear axis.
    if finite and max(finite) / min(finite) > 50:
        ax.set_yscale("log")
    _panel(ax, "Gradient norm (before clipping)", "grad norm")


def _plot_memory(ax, train) -> None:
    for key in sorted({k for r in train for k in r if k.startswith(MEMORY_PREFIX)}):
        _line(ax, train, key, label=_memory_name(key).replace("_", " "))
    ax.set_ylim(bottom=0)
    _panel(ax, "Memory", "GiB")
    ax.legend(fontsize=9)


def _plot_tasks(ax, evals, names: list[str]) -> None:
    """Each task metric over the steps, a colour per task and a line style per metric, its
    standard error shaded where logged. Scores within [0, 1] (accuracies) share the left axis;
    the rest (bits per byte, perplexities) go on a right one, dashed, on a log scale when they
    span more than 50x, so neither squashes the other."""
    from matplotlib import colormaps

    def points(name: str) -> tuple[list[int], list[float]]:
        return _series([r for r in evals if "step" in r], TASKS_PREFIX + name)

    def bounded(name: str) -> bool:
        return all(0.0 <= v <= 1.0 for v in points(name)[1] if math.isfinite(v))

    scores = [n for n in names if bounded(n)]
    others = [n for n in names if not bounded(n)]
    axes = [(ax, scores or others, "-")]
    if scores and others:
        axes.append((ax.twinx(), others, "--"))
    tasks = list(dict.fromkeys(n.rpartition("/")[0] for n in names))
    metrics = list(dict.fromkeys(n.rpartition("/")[2] for n in names))
    colors = colormaps["tab10" if len(tasks) <= 10 else "tab20"]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    for axis, group, style in axes:
        for name in group:
            task, _, metric = name.rpartition("/")
            steps, values = points(name)
            color = colors(tasks.index(task) % colors.N)
            axis.plot(
                steps,
                values,
                ls=style,
                marker=markers[metrics.index(metric) % len(markers)],
                ms=4,
                lw=1.2,
                color=color,
                label=name,
            )
            err = dict(zip(*points(_stderr_name(name)), strict=True))
            if err:
                band = [(s, v, err[s]) for s, v in zip(steps, values, strict=True) if s in err]
                axis.fill_between(
                    [s for s, _, _ in band],
                    [v - e for _, v, e in band],
                    [v + e for _, v, e in band],
                    color=color,
                    alpha=0.15,
                    lw=0,
                )
        positive = [v for n in group for v in points(n)[1] if math.isfinite(v) and v > 0]
        if group is others and positive and max(positive) / min(positive) > 50:
            axis.set_yscale("log")
        label = ", ".join(dict.fromkeys(n.rpartition("/")[2] for n in group))
        axis.set_ylabel(label if len(label) <= 40 else ("score" if group is scores else "value"))
    _panel(ax, "Benchmark tasks", ax.get_ylabel())
    handles = [h for axis, _, _ in axes for h in axis.get_legend_handles_labels()[0]]
    # Beside the panel, in as many columns as a long task list needs (the right axis's labels
    # are between them when there is one).
    ax.legend(
        handles=handles,
        fontsize=8 if len(handles) <= 12 else 7,
        loc="upper left",
        bbox_to_anchor=(1.07 if len(axes) > 1 else 1.01, 1.0),
        ncol=math.ceil(len(handles) / 14),
        borderaxespad=0,
    )


def _figure(width: float, height: float):
    # The object API with the Agg canvas, not pyplot: no display needed and no global backend
    # switched under a caller (a notebook, say) that imported kiln.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _saved(fig, fmt: str) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt)
    return buffer.getvalue()


def render_figure(run_dir: Path, records: list[dict[str, Any]], summary: dict[str, Any], fmt: str = "png") -> bytes:
    train, evals, events = split_records(records)
    if summary["tasks"]:
        # The six panels as always, and the task scores across the width below them.
        fig = _figure(16, 13.5)
        grid = fig.add_gridspec(3, 3)
        axes = grid[:2, :].subgridspec(2, 3).subplots()
        _plot_tasks(fig.add_subplot(grid[2, :]), evals, list(summary["tasks"]))
    else:
        fig = _figure(16, 9)
        axes = fig.subplots(2, 3)
    _plot_loss(axes[0, 0], train, evals, events)
    _plot_lr(axes[0, 1], train)
    _plot_throughput(axes[0, 2], train, summary["tokens_per_s_mean"])
    _plot_grad_norm(axes[1, 0], train)
    if summary["peak_memory_gib"]:
        _plot_memory(axes[1, 1], train)
    else:
        axes[1, 1].remove()
    # One step axis for every panel, from the start of training, so panels line up by eye; the
    # margin keeps the final evaluation's marker off the frame.
    last_step = max(r["step"] for r in records if "step" in r)
    for ax in fig.axes:
        ax.set_xlim(0, last_step * 1.02)
    text_ax = axes[1, 2]
    text_ax.axis("off")
    text_ax.text(
        0, 1, _panel_text(summary), va="top", ha="left", family="monospace", fontsize=11, transform=text_ax.transAxes
    )
    fig.suptitle(f"kiln report: {run_dir}\n{headline(summary)}", fontsize=13)
    return _saved(fig, fmt)


def render_expert_load(
    run_dir: Path, records: list[dict[str, Any]], summary: dict[str, Any], fmt: str = "png"
) -> bytes | None:
    """A heat map of each MoE layer's load, a panel per layer: the steps across, the experts up,
    the colour each expert's tokens over the layer's mean (white even, red busy, blue idle); None
    where the run logged no ``moe/load``."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    train = [r for r in split_records(records)[0] if isinstance(r.get(MOE_LOAD), dict)]
    if not train:
        return None
    steps = [r["step"] for r in train]
    # A record's load is that of the steps since the record before: its cell spans them, the
    # first as wide as the second (the run's first logged step need not be a whole interval).
    edges = [max(2 * steps[0] - steps[1] if len(steps) > 1 else steps[0] - 1, 0), *steps]
    layers = list(dict.fromkeys(name for r in train for name in r[MOE_LOAD]))
    grids = {}
    for layer in layers:
        rows = [r[MOE_LOAD].get(layer) or [] for r in train]
        n_experts = max(map(len, rows))
        # Over the mean, so that 1 is an even load whatever the number of experts; NaN where a
        # record lacks the layer.
        grid = np.full((n_experts, len(rows)), np.nan)
        for i, row in enumerate(rows):
            grid[: len(row), i] = np.asarray(row, dtype=float) * n_experts
        grids[layer] = np.ma.masked_invalid(grid)
    top = max([2.0, *(float(g.max()) for g in grids.values() if g.count())])
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    # Missing values grey: the white of the background is an even load's colour.
    cmap = colormaps["RdBu_r"].with_extremes(bad="lightgrey")
    cols = min(len(layers), math.ceil(math.sqrt(2 * len(layers))))
    n_rows = math.ceil(len(layers) / cols)
    fig = _figure(16, 1.5 + 3 * n_rows)
    axes = fig.subplots(n_rows, cols, sharex=True, sharey=True, squeeze=False).flatten()
    for ax in axes[len(layers) :]:
        ax.remove()
    for ax, (layer, grid) in zip(axes, grids.items(), strict=False):
        # An image, cells centred on their expert's number: an SVG or PDF of 48 layers x 128
        # experts drawn as one rectangle a cell would be slow to write and to open.
        mesh = ax.pcolorfast(edges, np.arange(grid.shape[0] + 1) - 0.5, grid, cmap=cmap, norm=norm)
        ax.set_title(layer, fontsize=10, loc="left")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[len(layers) - cols : len(layers)]:  # the lowest panel of each column shows the steps
        ax.xaxis.set_tick_params(labelbottom=True)
    fig.supxlabel("step")
    fig.supylabel("expert")
    fig.colorbar(mesh, ax=list(axes[: len(layers)]), label="tokens routed / the layer's mean (1 = even)")
    fig.suptitle(f"kiln report: {run_dir}, expert load by layer\n{headline(summary)}", fontsize=13)
    return _saved(fig, fmt)


def _panel_text(s: dict[str, Any]) -> str:
    """The summary's numbers, in the figure too: the PNG alone tells how the run went."""
    rows = [
        ("steps", _num(s["steps"])),
        ("tokens", _num(s["tokens"])),
        ("wall time", format_duration(s["wall_time_s"])),
        ("loss first", _num(s["loss_first"])),
        ("loss last", _num(s["loss_last"])),
        ("loss min", _num(s["loss_min"])),
        ("val loss best", _num(s["val_loss_best"])),
        ("val bpb best", _num(s["val_bpb_best"])),
        *(
            (("val accuracy best", _num(s["val_accuracy_best"])), ("val macro-F1 best", _num(s["val_macro_f1_best"])))
            if s["val_accuracy_best"] is not None
            else ()
        ),
        ("tokens/s mean", _num(s["tokens_per_s_mean"], ",.0f")),
    ]
    rows += [(f"{k.replace('_', ' ')} (max)", f"{_num(v, '.2f')} GiB") for k, v in s["peak_memory_gib"].items()]
    tasks = list(s["tasks"].items())
    rows += [(name, _num(score["last"])) for name, score in tasks[:PANEL_TASKS]]
    if len(tasks) > PANEL_TASKS:
        rows.append((f"+{len(tasks) - PANEL_TASKS} task metrics", "(report.txt)"))
    if s["moe_layers"] is not None:
        rows += [
            ("moe imbalance last", _num(s["moe_imbalance_last"])),
            ("moe imbalance max", _num(s["moe_imbalance_max"])),
            ("router entropy last", _num(s["moe_router_entropy_last"])),
        ]
    rows += [(f"event {kind}", f"x{n}") for kind, n in sorted(s["events"].items())]
    width = max(len(name) for name, _ in rows) + 2
    return "Summary\n\n" + "\n".join(f"{name:<{width}}{value}" for name, value in rows)


# -- writing --------------------------------------------------------------------------------------


def expert_load_path(out: Path) -> Path:
    """Where the expert-load heat map of the figure ``out`` goes: beside it, in its format
    (``report.png``: ``report_experts.png``)."""
    return out.with_name(f"{out.stem}_experts{out.suffix}")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write the figure to ``out`` (default ``RUN_DIR/report.png``; .svg and .pdf work too), the
    text summary beside it (``report.txt``) and, for a mixture of experts, its load's heat map
    (``report_experts.png``); return the summary's numbers. All are rendered before any is
    written, and each is replaced atomically, so a failure leaves no half-written report."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / REPORT_PNG
    fmt = out.suffix[1:].lower() or "png"
    if fmt not in FIGURE_FORMATS:
        raise ConfigError([f"--out {out}: the figure is written as {', '.join('.' + f for f in FIGURE_FORMATS)}"])
    records = read_metrics(run_dir)
    summary = summarize(records, _read_env(run_dir))
    figure = render_figure(run_dir, records, summary, fmt)
    experts = render_expert_load(run_dir, records, summary, fmt)
    text = format_summary(run_dir, summary)
    write_atomic(out, figure)
    if experts is not None:
        write_atomic(expert_load_path(out), experts)
    write_atomic(out.with_suffix(".txt"), text)
    return {
        **summary,
        "run_dir": str(run_dir),
        "figure": str(out),
        "experts_figure": str(expert_load_path(out)) if experts is not None else None,
        "text": str(out.with_suffix(".txt")),
    }


def _json_safe(value: Any) -> Any:
    """NaN and infinity are not JSON; null keeps the output readable by strict parsers (jq)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


# -- several runs: the comparison table --------------------------------------------------------

# The table's columns before the task metrics: (JSON key, heading).
COMPARE_COLUMNS = (
    ("steps", "steps"),
    ("loss_last", "final train loss"),
    ("val_loss_best", "best val loss"),
    ("val_bpb_best", "best val bpb"),
)
TABLE_FORMATS = ("md",)


def _run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, or the path as given where two runs share a name."""
    names = [d.name or d.resolve().name for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs, strict=True)]


def compare_runs(run_dirs: Sequence[str | Path]) -> dict[str, Any]:
    """The comparison of several runs: ``columns``, the task metrics any of them logged (name
    order), and ``runs``, one row each in the order given: its name, directory, steps, last train
    loss, best validation loss and bits per byte, and ``tasks``, the last value of every column
    (None where the run lacks it). Every run is read before any row is made; the runs that are
    not run directories are named together in one error."""
    dirs = [Path(d) for d in run_dirs]
    summaries, errors = [], []
    for run_dir in dirs:
        try:
            summaries.append(summarize(read_metrics(run_dir), _read_env(run_dir)))
        except CheckpointError as e:
            errors.append(str(e))
    if errors:
        raise CheckpointError("; ".join(errors))
    columns = sorted({name for s in summaries for name in s["tasks"]}, key=_natural)
    rows = [
        {
            "run": name,
            "run_dir": str(run_dir),
            **{key: s[key] for key, _ in COMPARE_COLUMNS},
            "tasks": {c: s["tasks"][c]["last"] if c in s["tasks"] else None for c in columns},
        }
        for name, run_dir, s in zip(_run_names(dirs), dirs, summaries, strict=True)
    ]
    return {"columns": columns, "runs": rows}


def _table_cells(table: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Headings and rows of text cells; blank where a run lacks the number."""
    headings = ["run", *(h for _, h in COMPARE_COLUMNS), *table["columns"]]

    def cell(value: Any) -> str:
        return "" if value is None else _num(value)

    rows = [
        [row["run"], *(cell(row[k]) for k, _ in COMPARE_COLUMNS), *(cell(row["tasks"][c]) for c in table["columns"])]
        for row in table["runs"]
    ]
    return headings, rows


def format_comparison(table: dict[str, Any]) -> str:
    """The table as aligned text: the run's name left, the numbers right."""
    headings, rows = _table_cells(table)
    widths = [max(len(r[i]) for r in [headings, *rows]) for i in range(len(headings))]

    def line(cells: list[str]) -> str:
        first, *rest = cells
        return "  ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))])

    return "\n".join(line(r).rstrip() for r in [headings, *rows]) + "\n"


def comparison_markdown(table: dict[str, Any]) -> str:
    """The table in GitHub markdown, the numbers right-aligned."""
    headings, rows = _table_cells(table)

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = "|" + "|".join([" --- ", *[" ---: "] * (len(headings) - 1)]) + "|"
    return "\n".join([line(headings), rule, *map(line, rows)]) + "\n"


def write_comparison(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> dict[str, Any]:
    """Compare several runs (compare_runs) and, with ``out``, write the table there as markdown
    (atomically); return the table, with ``markdown``, where it went (or None). Nothing is
    written into the runs' directories."""
    if out is not None and Path(out).suffix[1:].lower() not in TABLE_FORMATS:
        raise ConfigError([f"--out {out}: with several runs it names the comparison table, written as markdown (.md)"])
    table = compare_runs(run_dirs)
    if out is not None:
        write_atomic(Path(out), comparison_markdown(table))
    return {**table, "markdown": str(out) if out is not None else None}


def report_command(run_dirs: str | Sequence[str], out: str | None, as_json: bool) -> int:
    """``kiln report RUN_DIR [--out PATH] [--json]``: print the summary (or its numbers as JSON).
    ``kiln report RUN_DIR RUN_DIR... [--out TABLE.md] [--json]``: print the comparison table of
    the runs (or it as JSON), and with ``--out`` write it as markdown."""
    if not isinstance(run_dirs, str) and len(run_dirs) > 1:
        table = write_comparison(run_dirs, out)
        if as_json:
            print(json.dumps(_json_safe(table), indent=2))
        else:
            print(format_comparison(table), end="")
            if table["markdown"]:
                print(f"wrote {table['markdown']}")
        return 0
    run_dir = run_dirs if isinstance(run_dirs, str) else run_dirs[0]
    summary = write_report(run_dir, out)
    if as_json:
        print(json.dumps(_json_safe(summary), indent=2))
    else:
        print(format_summary(Path(run_dir), summary), end="")
        figures = [summary["figure"], *([summary["experts_figure"]] if summary["experts_figure"] else [])]
        print(f"wrote {', '.join(figures)} and {summary['text']}")
    return 0
