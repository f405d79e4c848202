"""``kiln report``: the figure and the summary of a run, the numbers checked against its
metrics.jsonl computed here independently."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kiln.checkpoint import CheckpointError
from kiln.cli import main as kiln
from kiln.config import ConfigError
from kiln.observe.report import report_command, write_report

from conftest import tiny_overrides

pytestmark = pytest.mark.e2e

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train(run: Path, corpus: Path, steps: int) -> None:
    items = tiny_overrides(run, corpus, train__max_steps=steps, eval__every=3, checkpoint__every=3)
    assert kiln(["train", *[a for item in items for a in ("--set", item)]]) == 0


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size == (1600, 900)
        # A blank or nearly blank figure compresses to a few KiB; curves and text do not.
        assert path.stat().st_size > 40_000


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, corpus_dir) -> Path:
    """A real run of 10 steps, interrupted after 6 (the second `kiln train` resumes it)."""
    run = tmp_path_factory.mktemp("report") / "run"
    _train(run, corpus_dir, 6)
    _train(run, corpus_dir, 10)
    return run


def test_report_of_a_real_run_matches_its_metrics(resumed_run):
    lines = _lines(resumed_run)
    train = {r["step"]: r for r in lines if "loss" in r}
    evals = {r["step"]: r for r in lines if "val_loss" in r}
    assert sorted(train) == list(range(1, 11)) and sorted(evals) == [3, 6, 9, 10]

    summary = write_report(resumed_run)

    _assert_png(resumed_run / "report.png")
    assert summary["steps"] == 10
    assert summary["tokens"] == 10 * 8 * 32  # steps x global batch x seq_len
    assert summary["global_batch"] == 8
    assert summary["invocations"] == 2
    # Each `kiln train` clocks itself: the wall time is the sum of the two.
    assert summary["wall_time_s"] == pytest.approx(train[6]["elapsed_s"] + train[10]["elapsed_s"])
    assert summary["loss_first"] == train[1]["loss"] and summary["loss_last"] == train[10]["loss"]
    assert summary["loss_min"] == min(r["loss"] for r in train.values())
    assert summary["val_loss_last"] == evals[10]["val_loss"]
    assert summary["val_loss_best"] == min(r["val_loss"] for r in evals.values())
    assert summary["val_bpb_last"] == evals[10]["val_bpb"]
    assert summary["val_bpb_best"] == min(r["val_bpb"] for r in evals.values())
    # Steps 1 and 7 open an invocation (warm-up): left out of the mean.
    steady = [train[s]["tokens_per_s"] for s in (2, 3, 4, 5, 6, 8, 9, 10)]
    assert summary["tokens_per_s_mean"] == pytest.approx(sum(steady) / len(steady))
    assert summary["peak_memory_gib"] == {"rss": max(r["memory/rss_gib"] for r in train.values())}
    assert summary["parameters"] == json.loads((resumed_run / "env.json").read_text())["parameters"]
    assert summary["events"] == {}

    text = (resumed_run / "report.txt").read_text()
    assert "steps        10 (2,560 tokens, global batch 8)" in text
    assert f"last {summary['val_loss_last']:.4g}" in text
    assert "events       none" in text


def test_report_command_prints_the_summary_or_strict_json(resumed_run, tmp_path, capsys):
    out = tmp_path / "elsewhere" / "curves.png"
    out.parent.mkdir()
    assert report_command(str(resumed_run), str(out), as_json=False) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"run          {resumed_run}\n") and f"wrote {out}" in printed
    _assert_png(out)
    assert (tmp_path / "elsewhere" / "curves.txt").read_text() in printed

    assert report_command(str(resumed_run), str(out), as_json=True) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 10 and summary["figure"] == str(out)

    assert kiln(["report", str(resumed_run), "--out", str(out), "--json"]) == 0  # the subcommand
    assert json.loads(capsys.readouterr().out)["steps"] == 10
    assert kiln(["report", str(tmp_path / "missing")]) == 2

    write_report(resumed_run, tmp_path / "curves.svg")
    assert (tmp_path / "curves.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(ConfigError, match="--out .*curves.jpg: the figure is written as .png, .svg, .pdf"):
        write_report(resumed_run, tmp_path / "curves.jpg")
    assert not (tmp_path / "curves.jpg").exists()


def _write_metrics(run: Path, records: list[dict], tail: str = "") -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _step(step, loss, **extra):
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 100.0 * step,
        "elapsed_s": float(step),
        "global_batch": 4,
        "tokens": 64 * step,
        **extra,
    }


def test_non_finite_values_events_and_a_torn_last_line(tmp_path, capsys):
    run = tmp_path / "run"
    records = [
        _step(1, 5.0),
        {"step": 2, "event": "out_of_memory", "message": "retrying with micro-batch 2", "micro_batch_size": 2},
        _step(2, 4.0, grad_norm=math.inf),
        _step(3, math.nan),
        {"step": 3, "val_loss": math.nan, "val_bpb": math.nan},
        {"step": 4, "event": "out_of_memory", "message": "retrying with micro-batch 1", "micro_batch_size": 1},
        _step(4, 3.0),
        {"step": 4, "val_loss": 3.5, "val_bpb": 1.5},
        _step(5, math.nan),
    ]
    # A run killed while writing leaves half a line at the end.
    _write_metrics(run, records, tail='{"step": 6, "loss": 2.')

    summary = write_report(run)

    _assert_png(run / "report.png")
    assert summary["steps"] == 5 and summary["tokens"] == 320
    assert summary["loss_first"] == 5.0 and math.isnan(summary["loss_last"]) and summary["loss_min"] == 3.0
    assert summary["nonfinite_losses"] == 2
    assert summary["val_loss_last"] == 3.5 and summary["val_loss_best"] == 3.5 and summary["val_bpb_best"] == 1.5
    assert summary["tokens_per_s_mean"] == pytest.approx((200 + 300 + 400 + 500) / 4)
    assert summary["events"] == {"out_of_memory": 2}
    assert summary["parameters"] is None and summary["peak_memory_gib"] == {}
    assert summary["experts_figure"] is None and not (run / "report_experts.png").exists()  # a dense model
    text = (run / "report.txt").read_text()
    assert "(2 non-finite)" in text and "events       out_of_memory x2" in text and "experts" not in text

    report_command(str(run), None, as_json=True)
    # Strict JSON: NaN is not a JSON value, so the last loss is null.
    summary = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert summary["loss_last"] is None and summary["loss_min"] == 3.0


def _expert_step(step: int, layers: int, experts: int, **extra) -> dict:
    """A training record of an MoE: expert 0 of each layer twice as busy as the rest."""
    shares = [2 / (experts + 1)] + [1 / (experts + 1)] * (experts - 1)
    load = {f"blocks.{layer}.mlp": shares for layer in range(1, layers + 1)}
    return _step(step, 5.0 - step / 10, **{"moe/load": load, **extra})


def test_expert_load_heat_map_and_numbers(tmp_path, capsys):
    run = tmp_path / "run"
    records = [
        _expert_step(s, 3, 8, **{"moe/imbalance": 3.0 - s / 10, "moe/min_load": 0.5, "moe/router_entropy": 2.0})
        for s in range(2, 22, 2)
    ]
    del records[4]["moe/load"]["blocks.2.mlp"]  # a layer missing from a record is left blank
    records[2]["moe/dropped"] = 0.03  # logged only where an interval dropped tokens
    records.append({"step": 20, "val_loss": 3.5, "val_bpb": 1.5})
    _write_metrics(run, records)

    summary = write_report(run)

    heat_map = run / "report_experts.png"
    assert summary["experts_figure"] == str(heat_map)
    assert heat_map.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(heat_map) as image:
        assert image.size == (1600, 450)  # one row of three layers
        pixels = np.asarray(image.convert("RGB")).astype(int)
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    # Expert 0, twice as busy as the mean, in red: an eighth of the panels.
    assert 0.05 < ((r > 150) & (g < 100) & (b < 100)).mean() < 0.09
    # The interval that lacks a layer is grey (211, 211, 211), not an even load's white.
    assert ((r == 211) & (g == 211) & (b == 211)).sum() > 5_000
    assert summary["moe_layers"] == 3 and summary["moe_experts"] == 8
    assert summary["moe_imbalance_last"] == pytest.approx(1.0) and summary["moe_imbalance_max"] == pytest.approx(2.8)
    assert summary["moe_router_entropy_last"] == 2.0 and summary["moe_dropped_max"] == 0.03
    text = (run / "report.txt").read_text()
    assert "experts      3 layers x 8: imbalance last 1  max 2.8  min load last 0.5\n" in text
    assert "router       entropy last 2 nats (at most ln 8 = 2.079)  dropped max 3.00%\n" in text

    # Named after the figure, in its format; the command lists it with the others.
    report_command(str(run), str(tmp_path / "curves.svg"), as_json=False)
    assert f"wrote {tmp_path / 'curves.svg'}, {tmp_path / 'curves_experts.svg'} and" in capsys.readouterr().out
    assert (tmp_path / "curves_experts.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such run directory"),
        ("file", "not a directory"),
        ("no_metrics", "missing metrics.jsonl"),
        ("empty", "no training steps logged yet"),
        ("events_only", "no training steps logged yet"),
        ("corrupt", "metrics.jsonl:2: not a JSON record"),
    ],
)
def test_unreportable_directories_name_the_path_and_write_nothing(tmp_path, case, message):
    run = tmp_path / "run"
    if case == "file":
        run.write_text("")
    elif case == "no_metrics":
        run.mkdir()
    elif case == "empty":
        _write_metrics(run, [])
    elif case == "events_only":
        _write_metrics(run, [{"step": 0, "event": "micro_batch_size", "message": "chose 8"}])
    elif case == "corrupt":
        _write_metrics(run, [_step(1, 5.0)], tail="not json\n" + json.dumps(_step(2, 4.0)) + "\n")
    # CheckpointError is what the CLI reports as one line and exit status 2.
    with pytest.raises(CheckpointError, match=message) as info:
        write_report(run)
    assert str(run) in str(info.value)
    assert not list(tmp_path.rglob("report*")) and not list(tmp_path.rglob("*.tmp"))
