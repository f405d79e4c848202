"""A run's checkpoints form a line: resuming from an older checkpoint than the newest (a rollback
after a loss spike, say) trains a new branch, whose checkpoints the rotation keeps and a later
``--resume auto`` continues, while the branch left behind is set aside, never resumed."""

from __future__ import annotations

import json
import shutil
import time

from safetensors.torch import load_file

from conftest import tiny_overrides
from kilnrun import forked, in_process, losses, sets


def _steps(directory):
    return sorted(int(p.name[5:]) for p in directory.glob("step-*"))


def test_a_rollback_trains_a_new_branch_that_survives_rotation_and_a_later_resume_continues(tmp_path, corpus_dir):
    run = tmp_path / "run"
    in_process("train", *sets(tiny_overrides(run, corpus_dir, checkpoint__every=4, checkpoint__keep=3)))
    assert _steps(run / "checkpoints") == [4, 8, 12]
    reference = tmp_path / "reference"
    shutil.copytree(run, reference)

    # Back to step 4 with a lower learning rate, a checkpoint every 2 steps and only the newest
    # kept; killed once the branch has saved step 8 (each save takes 1 s more here).
    branch = dict(train__lr=3e-3, checkpoint__every=2, checkpoint__keep=1, debug__slow_save_seconds=1)
    older = run / "checkpoints" / "step-00000004"
    printed = tmp_path / "branch.out"
    proc = forked("train", "--resume", older, *sets(tiny_overrides(run, corpus_dir, **branch)), output=printed)
    deadline, aside = time.time() + 120, run / "checkpoints" / "abandoned-*"
    while time.time() < deadline:  # the old branch set aside, the new one's step 8 saved and rotated
        moved = [_steps(p) for p in aside.parent.glob(aside.name)]
        # Waiting for the rotation too: a kill between step 8's rename and step 6's removal
        # leaves both (harmless: the next save rotates), which a loaded machine hit.
        if moved == [[8, 12]] and _steps(run / "checkpoints") == [8]:
            break
        time.sleep(0.02)
    proc.kill()  # SIGKILL
    proc.join()
    out = printed.read_text()
    # The newest checkpoint is the branch's (step 6 rotated away, the one just written kept);
    # the old branch's steps 8 and 12 are set aside, with one line.
    assert _steps(run / "checkpoints") == [8]
    [aside] = (run / "checkpoints").glob("abandoned-*")
    assert _steps(aside) == [8, 12]
    assert (
        f"kiln: a new branch from step 4: the later checkpoints (step-00000008, step-00000012) are set aside in {aside}"
        in out
    )

    # A plain resume continues the branch (not the old step 12) and ends as the branch trained
    # without a stop.
    plain = dict(branch, debug__slow_save_seconds=0)
    in_process("train", *sets(tiny_overrides(run, corpus_dir, **plain)))
    in_process(
        "train",
        "--resume",
        reference / "checkpoints" / "step-00000004",
        *sets(tiny_overrides(reference, corpus_dir, **plain)),
    )
    assert losses(run) == losses(reference) and 5 in losses(run)
    final = "checkpoints/step-00000012/model.safetensors"
    a, b = load_file(run / final), load_file(reference / final)
    assert all((a[k] == b[k]).all() for k in a)
    assert _steps(run / "checkpoints") == [12] and _steps(aside) == [8, 12]


def test_a_torn_last_line_of_the_metrics_is_dropped_with_a_warning_when_the_run_resumes(tmp_path, corpus_dir):
    run = tmp_path / "run"
    in_process("train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=8)))
    metrics = run / "metrics.jsonl"
    torn = len(metrics.read_text().splitlines()) + 1
    with open(metrics, "a") as f:
        f.write('{"step": 9, "loss": 2.')  # the disk filled up mid-line
    proc = in_process("train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=12)))
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, 13))
    assert (
        f"kiln: warning: {metrics}: line {torn} cut short (a kill while writing, or a full disk): dropped"
        in proc.stderr
    )


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_the_run_resumes_exactly(tmp_path, corpus_dir):
    """The second checkpoint's write finds no space left (debug.disk_full_save): one line, exit
    2, no half-written directory; once there is room, the same command resumes from the first
    and ends as the run that never failed."""
    common = dict(checkpoint__every=4, checkpoint__keep=10)
    full = tmp_path / "full"
    in_process("train", *sets(tiny_overrides(full, corpus_dir, **common)))
    run = tmp_path / "run"
    failed = in_process("train", *sets(tiny_overrides(run, corpus_dir, **common, debug__disk_full_save=2)), check=False)
    assert failed.returncode == 2
    [line] = [line for line in failed.stderr.splitlines() if "error" in line]
    first = run / "checkpoints" / "step-00000004"
    assert line == (
        f"kiln: error: {run / 'checkpoints' / 'step-00000008'}: not written: No space left on device (injected by "
        f"debug.disk_full_save); the checkpoint before it, {first}, is intact: make room and run the same command "
        "to resume"
    )
    assert _steps(run / "checkpoints") == [4] and not list((run / "checkpoints").glob(".tmp-*"))
    again = in_process("train", *sets(tiny_overrides(run, corpus_dir, **common)))
    assert f"kiln: resumed from {first} at step 4" in again.stdout
    assert losses(run) == losses(full)
    final = "checkpoints/step-00000012/model.safetensors"
    a, b = load_file(run / final), load_file(full / final)
    assert all((a[k] == b[k]).all() for k in a)
