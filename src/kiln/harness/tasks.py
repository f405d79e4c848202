"""Benchmark tasks through lm-evaluation-harness: finding them, scoring a model on them, and
where their results go.

Tasks come from lm-eval's own registry or from task YAML files under an include path; their data
must be on this machine (a registry task's in the Hugging Face datasets cache, a YAML task's in
the local files it names): the datasets library is put offline, so nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TaskError(ValueError):
    """A task that cannot be run: the message names the task, the file or the directory."""


def offline() -> None:
    """Keep the datasets library and the Hub client from the network, whether they are imported
    yet or not (their settings are read from the environment when they are first imported, so
    those already imported are set directly)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


def task_manager(include_path: str | os.PathLike | None = None, names: Sequence[str] = ()):
    """lm-eval's TaskManager over its registry and ``include_path`` (TaskError unless that is a
    directory holding task YAML files); over ``include_path`` alone where it holds every task of
    ``names``: indexing lm-eval's own thousands of task files takes seconds (6 s on a 2-core
    Xeon, 9 on an EPYC). A process indexes the same files once: a manager is kept for each
    include path as long as its YAML files are the same (names, sizes, modification times)."""
    where: str | None = None
    files: tuple[tuple[str, int, int], ...] = ()
    if include_path is not None:
        path = Path(include_path).expanduser()
        if not path.is_dir():
            raise TaskError(f"--include-path {path}: not a directory")
        files = _yaml_files(path)
        if not files:
            raise TaskError(f"--include-path {path}: no task YAML files (*.yaml) in it")
        where = str(path.resolve()) if include_path else None
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise TaskError(f"benchmark tasks need lm-evaluation-harness ({e}); pip install 'kiln[eval]'") from None
    offline()
    if where and names:
        own = _indexed(where, False, files)
        if set(names) <= set(own.all_tasks):
            return own
    return _indexed(where, True, files)


def _yaml_files(path: Path) -> tuple[tuple[str, int, int], ...]:
    """The task files under ``path``, each with its size and modification time."""
    found = [p for pattern in ("*.yaml", "*.yml") for p in path.rglob(pattern)]
    return tuple(sorted((str(p), (st := p.stat()).st_size, st.st_mtime_ns) for p in found))


@functools.lru_cache(maxsize=8)
def _indexed(where: str | None, defaults: bool, files: tuple[tuple[str, int, int], ...]) -> Any:
    """A TaskManager over ``where`` (and lm-eval's registry with ``defaults``) whose YAML files
    were ``files`` (part of the cache's key: edited files are indexed again)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=where, include_defaults=defaults)


def check_tasks(names: list[str], manager) -> None:
    """TaskError naming the first task that is not known or whose data cannot be read here."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            where = f" or under {manager.include_path}" if manager.include_path else ""
            raise TaskError(
                f"task {name!r}: no such task in lm-eval's registry{where} "
                f"(lm-eval knows {len(known):,} tasks; `lm-eval ls tasks` lists them)"
            )
        try:
            manager.load([name])
        except Exception as e:  # datasets and lm-eval raise many kinds for data they cannot read
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TaskError(f"task {name!r}: its data cannot be read on this machine ({first})") from None


def run_tasks(
    lm,
    names: list[str],
    manager,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
) -> dict[str, Any] | None:
    """lm-eval's ``simple_evaluate`` of ``lm`` on the tasks: its own result dictionary; None in a
    launched job's processes other than its node's first (lm-eval reads LOCAL_RANK), which score
    the same requests but report nothing."""
    from lm_eval.evaluator import simple_evaluate

    results = simple_evaluate(
        model=lm,
        tasks=list(names),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
    )
    return results


def scores(results: dict[str, Any]) -> dict[str, float]:
    """The results' metrics as ``tasks/<task>/<metric>`` (``<metric>/<filter>`` where a task
    filters its answers other than lm-eval's "none"), standard errors left out."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, int | float):
                continue
            metric, filt = key.split(",", 1)
            out[f"tasks/{task}/{metric}" + ("" if filt == "none" else f"/{filt}")] = float(value)
    return out


def write_results(results: dict[str, Any], directory: Path) -> list[Path]:
    """Each task's results as ``directory/<task>.json`` in lm-eval's own format (its results,
    config, version, shots, sample counts and the run's settings), and its logged samples as
    ``<task>.samples.jsonl`` if there are any; the files written."""
    from lm_eval.utils import handle_non_serializable

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    shared = {k: results[k] for k in ("config", "git_hash", "date", "lm_eval_version") if k in results}
    for task in results["results"]:
        part = {
            key: {task: results[key][task]}
            for key in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
            if task in results.get(key, {})
        }
        path = directory / f"{task}.json"
        path.write_text(json.dumps({**part, **shared}, indent=2, default=handle_non_serializable) + "\n")
        written.append(path)
        samples = results.get("samples", {}).get(task)
        if samples:
            lines = (json.dumps(s, default=handle_non_serializable) for s in samples)
            (directory / f"{task}.samples.jsonl").write_text("\n".join(lines) + "\n")
    return written


def table(results: dict[str, Any]) -> str:
    """lm-eval's own table of the results (and of their groups, if any)."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text
