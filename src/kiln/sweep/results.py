"""What a study found, written into its directory: ``trials.csv`` (one row per trial),
``best.toml`` (the best trial's resolved config, which ``kiln train`` takes as it is), ``sweep.png``
(the optimization history, each trial's evaluations, and parameter importances), and a table
for the console. Everything is read from the study, so any sweep process can write it."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

from kiln.config import from_dict, tomllib
from kiln.io import write_atomic
from kiln.sweep.space import Param
from kiln.sweep.study import trial_dir

CSV = "trials.csv"
BEST = "best.toml"
FIGURE = "sweep.png"
STATE_COLORS = {"COMPLETE": "tab:blue", "PRUNED": "tab:gray", "FAIL": "tab:red", "RUNNING": "tab:green"}


def trial_rows(study, params: list[Param], study_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        row = {"number": t.number, "state": t.state.name, "value": t.value if t.values else ""}
        row.update({p.key: t.params.get(p.key, "") for p in params})
        row["run_dir"] = str(trial_dir(study_dir, t.number))
        row["intermediate"] = json.dumps(dict(sorted(t.intermediate_values.items())))
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]], params: list[Param]) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, ["number", "state", "value", *(p.key for p in params), "run_dir", "intermediate"])
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, out.getvalue())


def format_table(rows: list[dict[str, Any]], params: list[Param], objective: str) -> str:
    """The trials as aligned columns: number, state, objective, parameters, last evaluated step."""

    def cell(value: Any) -> str:
        return f"{value:.5g}" if isinstance(value, float) else str(value)

    header = ["trial", "state", objective, *(p.key for p in params), "step"]
    body = [
        [
            str(r["number"]),
            r["state"],
            cell(r["value"]),
            *(cell(r[p.key]) for p in params),
            str(max(map(int, json.loads(r["intermediate"])), default="")),
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in [header, *body])


def write_best(study, study_dir: Path, objective: str) -> Path | None:
    """``best.toml``: the resolved config of the best complete trial, training into a fresh
    ``best-NNNN`` directory of the study (or the ``--set run.dir`` given with it)."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not complete:
        return None
    best = study.best_trial
    run_dir = trial_dir(study_dir, best.number)
    cfg = from_dict(tomllib.loads((run_dir / "config.toml").read_text()))
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(study_dir / f"best-{best.number:04d}")))
    path = study_dir / BEST
    header = (
        f"# The best of {len(complete)} complete trials of the sweep in {study_dir}: trial {best.number} "
        f"({run_dir}), {objective} = {best.value!r}.\n"
        "# kiln train with this file trains it again, the same to the last bit on the same machine.\n\n"
    )
    write_atomic(path, header + cfg.to_toml())
    return path


def importances(study, seed: int) -> dict[str, float]:
    """Each parameter's share of the objective's variance over the complete trials (fANOVA)."""
    import optuna

    if sum(t.state.name == "COMPLETE" for t in study.get_trials(deepcopy=False)) < 2:
        return {}
    try:
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=seed)
        return optuna.importance.get_param_importances(study, evaluator=evaluator)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}  # e.g. every trial scored the same: there is no variance to share out


def render_figure(study, study_dir: Path, objective: str, seed: int) -> bytes:
    # The object API with the Agg canvas, as kiln report draws: no display, no global backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    trials = study.get_trials(deepcopy=False)
    fig = Figure(figsize=(18, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    history, curves, bars = fig.subplots(1, 3)
    _plot_history(history, trials, objective, study.direction.name == "MAXIMIZE")
    _plot_curves(curves, trials, objective)
    _plot_importances(bars, importances(study, seed))
    counts = {s: sum(t.state.name == s for t in trials) for s in STATE_COLORS}
    title = f"kiln sweep: {study_dir} | {len(trials)} trials: " + ", ".join(
        f"{n} {s.lower()}" for s, n in counts.items() if n
    )
    fig.suptitle(title, fontsize=13)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _panel(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=12, loc="left", fontweight="bold")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _plot_history(ax, trials, objective: str, maximize: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    for state, marker in (("COMPLETE", "o"), ("PRUNED", "x")):
        points = [(t.number, t.value) for t in trials if t.state.name == state and t.value is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker, color=STATE_COLORS[state], label=state.lower())
    complete = sorted((t.number, t.value) for t in trials if t.state.name == "COMPLETE")
    if complete:
        best, line = -math.inf if maximize else math.inf, []
        for number, value in complete:
            best = max(best, value) if maximize else min(best, value)
            line.append((number, best))
        ax.plot(*zip(*line, strict=True), drawstyle="steps-post", color="tab:red", label="best so far")
        ax.legend(fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _panel(ax, "Optimization history", "trial", objective)


def _plot_curves(ax, trials, objective: str) -> None:
    for t in trials:
        if t.intermediate_values:
            steps, values = zip(*sorted(t.intermediate_values.items()), strict=True)
            ax.plot(steps, values, "o-", ms=3, lw=1, alpha=0.7, color=STATE_COLORS.get(t.state.name, "tab:olive"))
    for state, color in STATE_COLORS.items():  # one legend entry per state, however many trials
        ax.plot([], [], color=color, label=state.lower())
    ax.legend(fontsize=9)
    _panel(ax, "Evaluations of each trial", "step", objective)


def _plot_importances(ax, shares: dict[str, float]) -> None:
    _panel(ax, "Parameter importances (fANOVA)", "share of the variance", "")
    if not shares:
        ax.text(0.5, 0.5, "needs 2 complete trials that differ", ha="center", va="center", transform=ax.transAxes)
        return
    names = list(shares)[::-1]  # the most important on top
    bars = ax.barh(names, [shares[n] for n in names], height=0.5, color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", padding=3)
    ax.set_xlim(0, 1.1)
    ax.set_ylim(-0.75, len(names) - 0.25)


def write_results(study, params: list[Param], study_dir: Path, objective: str, seed: int) -> Path | None:
    """trials.csv, best.toml and sweep.png; the path of best.toml (None before any trial completed)."""
    write_csv(study_dir / CSV, trial_rows(study, params, study_dir), params)
    best = write_best(study, study_dir, objective)
    write_atomic(study_dir / FIGURE, render_figure(study, study_dir, objective, seed))
    return best
