"""``kiln report`` and benchmark task scores (``tasks/<task>/<metric>`` in metrics.jsonl): their
last values in the summary, their panel in the figure, and the comparison table of several runs
(text, JSON, markdown). The metrics files are written here by hand, as the trainer writes them,
plus one real tiny run with task records added to its file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_report import _step as step_record

from kiln.cli import main as kiln
from kiln.observe.report import (
    _is_stderr,
    _stderr_name,
    compare_runs,
    comparison_markdown,
    format_comparison,
    report_command,
    split_records,
    write_comparison,
    write_report,
)

from conftest import tiny_overrides

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run: Path, records: list[dict]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def _step(step: int, loss: float) -> dict:
    return step_record(step, loss, **{"memory/rss_gib": 0.5})


def _plain(run: Path, steps: int = 20, loss0: float = 5.0) -> Path:
    """A run without task scores: training steps and validations every 5."""
    records = [_step(s, loss0 - s / 10) for s in range(1, steps + 1)]
    records += [{"step": s, "val_loss": loss0 - s / 20, "val_bpb": 2 - s / 100} for s in range(5, steps + 1, 5)]
    return _write_metrics(run, records)


def _with_tasks(run: Path) -> Path:
    """A run whose task scores arrive alone at steps 5, 10 and 20 (as the in-loop evaluation logs
    them) and once with the validation loss (step 15), with standard errors for hellaswag."""
    records = [_step(s, 5.0 - s / 10) for s in range(1, 21)]
    for s in (5, 10, 15, 20):
        scores = {
            "tasks/hellaswag/acc": 0.25 + s / 100,
            "tasks/hellaswag/acc_stderr": 0.01 * s,
            "tasks/hellaswag/acc_norm": 0.3 + s / 100,
            "tasks/wiki/bits_per_byte": 3.0 - s / 20,
        }
        if s == 15:
            records.append({"step": s, "val_loss": 4.0, "val_bpb": 1.8, **scores})
        else:
            records.append({"step": s, **scores})
    # A metric measured only once, and earlier than the rest.
    records.append({"step": 10, "tasks/my_mc/acc_norm": 0.5})
    return _write_metrics(run, records)


def _image(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB")).astype(int)


def test_split_records_takes_records_of_task_scores_alone_as_evaluations(tmp_path):
    records = [
        _step(1, 5.0),
        {"step": 1, "tasks/hellaswag/acc": 0.3},
        {"step": 2, "val_loss": 4.0, "tasks/hellaswag/acc": 0.4},
        {"step": 2, "event": "spike", "message": "x"},
    ]
    train, evals, events = split_records(records)
    assert train == records[:1] and evals == records[1:3] and events == records[3:]


def test_standard_errors_are_paired_with_their_metric_not_metrics_of_their_own():
    assert _is_stderr("hellaswag/acc_stderr") and not _is_stderr("hellaswag/acc")
    assert _is_stderr("gsm8k/exact_match_stderr,strict-match")
    assert not _is_stderr("gsm8k/exact_match,strict-match")
    assert _stderr_name("hellaswag/acc") == "hellaswag/acc_stderr"
    assert _stderr_name("gsm8k/exact_match,strict-match") == "gsm8k/exact_match_stderr,strict-match"


def test_task_scores_in_the_summary_text_and_a_panel_of_the_figure(tmp_path):
    run = _with_tasks(tmp_path / "run")

    summary = write_report(run)

    assert summary["tasks"] == {
        "hellaswag/acc": {"last": pytest.approx(0.45), "step": 20, "stderr": pytest.approx(0.2), "points": 4},
        "hellaswag/acc_norm": {"last": pytest.approx(0.5), "step": 20, "stderr": None, "points": 4},
        "my_mc/acc_norm": {"last": 0.5, "step": 10, "stderr": None, "points": 1},
        "wiki/bits_per_byte": {"last": pytest.approx(2.0), "step": 20, "stderr": None, "points": 4},
    }
    # The task records do not disturb the validation numbers.
    assert summary["val_loss_last"] == 4.0 and summary["val_bpb_best"] == 1.8
    text = (run / "report.txt").read_text()
    assert (
        "val bpb      last 1.8  best 1.8\n"
        "tasks        hellaswag/acc       0.45 ± 0.2  (step 20)\n"
        "             hellaswag/acc_norm  0.5  (step 20)\n"
        "             my_mc/acc_norm      0.5  (step 10)\n"
        "             wiki/bits_per_byte  2  (step 20)\n"
        "tokens/s" in text
    )

    pixels = _image(run / "report.png")
    # The six panels as before, and the task panel below them across the width.
    assert pixels.shape == (1350, 1600, 3)
    bottom = pixels[950:, :1300]
    r, g, b = bottom[..., 0], bottom[..., 1], bottom[..., 2]
    # tab10's first colour (hellaswag, blue) and its shaded standard error are drawn there.
    assert ((abs(r - 31) < 8) & (abs(g - 119) < 8) & (abs(b - 180) < 8)).sum() > 300
    assert ((b > 200) & (r > 180) & (r < 235) & (g > 200) & (g < 240)).sum() > 2_000  # the light blue band


def test_a_run_without_task_scores_renders_as_before(tmp_path):
    run = _plain(tmp_path / "run")
    summary = write_report(run)
    assert summary["tasks"] == {}
    pixels = _image(run / "report.png")
    assert pixels.shape == (900, 1600, 3)
    text = (run / "report.txt").read_text()
    assert "tasks" not in text
    assert text.splitlines()[5:8] == [
        "val loss     last 4  best 4",
        "val bpb      last 1.8  best 1.8",
        "tokens/s     1,100 mean (first interval of each invocation left out)",
    ]


def test_many_task_metrics_fit_and_the_json_stays_strict(tmp_path, capsys):
    """An MMLU-like suite: 30 subtasks, a perplexity far from the scores, a NaN, a filtered
    metric name with its standard error, a non-numeric value and a record without a step."""
    records = [_step(s, 5.0 - s / 100) for s in range(1, 101)]
    for s in (25, 50, 75, 100):
        scores: dict[str, float | str] = {f"tasks/mmlu_{i}/acc": 0.25 + i / 100 for i in range(30)}
        scores["tasks/gsm8k/exact_match,strict-match"] = math.nan if s == 100 else s / 1000
        scores["tasks/gsm8k/exact_match_stderr,strict-match"] = 0.01
        scores["tasks/wiki/word_perplexity"] = 1e6 / s**2
        scores["tasks/mmlu/alias"] = "mmlu"
        records.append({"step": s, **scores})
    records.append({"tasks/nostep/acc": 1.0})
    run = _write_metrics(tmp_path / "run", records)

    assert report_command(str(run), None, as_json=True) == 0
    summary = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    tasks = summary["tasks"]
    assert len(tasks) == 32 and "mmlu/alias" not in tasks and "nostep/acc" not in tasks
    assert list(tasks)[:4] == ["gsm8k/exact_match,strict-match", "mmlu_0/acc", "mmlu_1/acc", "mmlu_2/acc"]
    assert tasks["gsm8k/exact_match,strict-match"] == {"last": None, "step": 100, "stderr": 0.01, "points": 4}
    assert tasks["wiki/word_perplexity"]["last"] == 100.0
    assert _image(run / "report.png").shape == (1350, 1600, 3)
    assert "+26 task metrics" not in (run / "report.txt").read_text()  # the text lists every one
    assert "mmlu_29/acc" in (run / "report.txt").read_text()


def _runs(tmp_path: Path) -> list[Path]:
    """Three runs: one without tasks, one with four, one with another task (and no validation)."""
    base = _plain(tmp_path / "base", steps=30, loss0=6.0)
    tasks = _with_tasks(tmp_path / "tasks")
    other = _write_metrics(
        tmp_path / "other",
        [_step(s, 4.0 - s / 100) for s in range(1, 11)]
        + [{"step": 10, "tasks/arc_easy/acc": 0.61, "tasks/hellaswag/acc": 0.3}],
    )
    return [base, tasks, other]


TABLE = (
    "run    steps  final train loss  best val loss  best val bpb  arc_easy/acc  hellaswag/acc"
    "  hellaswag/acc_norm  my_mc/acc_norm  wiki/bits_per_byte\n"
    "base      30                 3            4.5           1.7\n"
    "tasks     20                 3              4           1.8                         0.45"
    "                 0.5             0.5                   2\n"
    "other     10               3.9                                       0.61            0.3\n"
)


def test_comparison_table_of_several_runs(tmp_path):
    runs = _runs(tmp_path)
    table = compare_runs(runs)
    assert table["columns"] == [
        "arc_easy/acc",
        "hellaswag/acc",
        "hellaswag/acc_norm",
        "my_mc/acc_norm",
        "wiki/bits_per_byte",
    ]
    base, tasks, other = table["runs"]
    assert base["run"] == "base" and base["run_dir"] == str(runs[0]) and base["steps"] == 30
    assert base["loss_last"] == pytest.approx(3.0) and base["val_loss_best"] == pytest.approx(4.5)
    assert set(base["tasks"].values()) == {None}
    assert tasks["tasks"]["hellaswag/acc"] == pytest.approx(0.45) and tasks["tasks"]["arc_easy/acc"] is None
    assert other["val_loss_best"] is None and other["tasks"]["arc_easy/acc"] == 0.61
    assert format_comparison(table) == TABLE
    assert comparison_markdown(table).splitlines() == [
        "| run | steps | final train loss | best val loss | best val bpb | arc_easy/acc | hellaswag/acc"
        " | hellaswag/acc_norm | my_mc/acc_norm | wiki/bits_per_byte |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| base | 30 | 3 | 4.5 | 1.7 |  |  |  |  |  |",
        "| tasks | 20 | 3 | 4 | 1.8 |  | 0.45 | 0.5 | 0.5 | 2 |",
        "| other | 10 | 3.9 |  |  | 0.61 | 0.3 |  |  |  |",
    ]
    # Runs of the same name are told apart by their paths.
    twins = [_plain(tmp_path / "a" / "run"), _plain(tmp_path / "b" / "run")]
    assert [r["run"] for r in compare_runs(twins)["runs"]] == [str(twins[0]), str(twins[1])]


def test_kiln_report_of_several_runs_prints_the_table_json_and_markdown(tmp_path, capsys):
    runs = [str(r) for r in _runs(tmp_path)]
    assert kiln(["report", *runs]) == 0
    assert capsys.readouterr().out == TABLE
    # A comparison writes nothing into the runs.
    assert not list(tmp_path.rglob("report*"))

    out = tmp_path / "compare.md"
    assert kiln(["report", *runs, "--out", str(out)]) == 0
    assert capsys.readouterr().out == TABLE + f"wrote {out}\n"
    assert out.read_text() == comparison_markdown(compare_runs(runs))

    assert kiln(["report", *runs, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert printed == {**json.loads(json.dumps(compare_runs(runs))), "markdown": None}
    assert [r["run"] for r in printed["runs"]] == ["base", "tasks", "other"]
    assert printed["runs"][0]["tasks"]["hellaswag/acc"] is None
    assert write_comparison(runs, out)["markdown"] == str(out)

    # One run: the report as always.
    assert kiln(["report", runs[1]]) == 0
    assert capsys.readouterr().out.startswith(f"run          {runs[1]}\n")
    assert (Path(runs[1]) / "report.png").is_file()


def test_several_runs_name_every_bad_one_in_one_line_and_write_nothing(tmp_path, capsys):
    good = str(_plain(tmp_path / "good"))
    (tmp_path / "file").write_text("")
    (tmp_path / "empty").mkdir()
    missing, file, empty = (str(tmp_path / n) for n in ("missing", "file", "empty"))
    out = tmp_path / "compare.md"
    assert kiln(["report", good, missing, file, empty, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kiln: error: ")
    assert f"{missing}: no such run directory" in err and f"{file}: not a directory" in err
    assert f"{empty}: not a kiln run directory (missing metrics.jsonl)" in err and good not in err
    assert not out.exists()

    # With several runs --out names the markdown table; a figure's name is refused.
    assert kiln(["report", good, good, "--out", str(tmp_path / "compare.png")]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "compare.png").exists()
    assert not list(tmp_path.rglob("report*"))


@pytest.mark.e2e
def test_a_real_run_with_task_scores_appended(tmp_path, corpus_dir, capsys):
    """A real tiny run, its metrics.jsonl given the task records the in-loop evaluation writes at
    its evaluation steps: reported and compared with a run that has none."""
    run = tmp_path / "run"
    items = tiny_overrides(run, corpus_dir, train__max_steps=6, eval__every=3, checkpoint__every=6)
    assert kiln(["train", *[a for item in items for a in ("--set", item)]]) == 0
    with (run / "metrics.jsonl").open("a") as f:
        for step, acc in ((3, 0.25), (6, 0.5)):
            f.write(json.dumps({"step": step, "tasks/local_mc/acc": acc, "tasks/local_mc/acc_stderr": 0.1}) + "\n")
    capsys.readouterr()

    assert kiln(["report", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "tasks        local_mc/acc  0.5 ± 0.1  (step 6)\n" in printed
    assert _image(run / "report.png").shape == (1350, 1600, 3)

    plain = _plain(tmp_path / "plain")
    assert kiln(["report", str(run), str(plain), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["runs"]
    assert rows[0]["run"] == "run" and rows[0]["steps"] == 6 and rows[0]["tasks"] == {"local_mc/acc": 0.5}
    assert rows[0]["val_loss_best"] == min(
        r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").open()) if "val_loss" in r
    )
    assert rows[1]["tasks"] == {"local_mc/acc": None}
