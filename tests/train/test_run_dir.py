"""A run writes only into its own run directory: a second ``kiln train`` on a directory being
trained stops at once naming the first, and a directory that holds files but no kiln run is
refused before anything is written into it."""

from __future__ import annotations

import os
import socket
import time

from conftest import tiny_overrides
from kilnrun import forked, in_process, sets


def test_a_second_train_on_a_run_directory_being_trained_stops_naming_the_first(tmp_path, corpus_dir):
    run = tmp_path / "run"
    # Slow checkpoints keep the first run going while the second one starts.
    first = forked("train", *sets(tiny_overrides(run, corpus_dir, debug__slow_save_seconds=2)))
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").exists():
        time.sleep(0.05)
    try:
        second = in_process("train", *sets(tiny_overrides(run, corpus_dir)), check=False)
        assert second.returncode == 2
        holder = f"kiln train (pid {first.pid} on {socket.gethostname()})"
        assert f"kiln: config error: run.dir: {run} is being trained by {holder}; wait for it to end" in second.stderr
    finally:
        first.kill()  # SIGKILL
        first.join()
    # Killed, the first holds nothing: the directory trains again.
    in_process("train", *sets(tiny_overrides(run, corpus_dir)))


def test_a_directory_of_other_files_is_refused_and_left_as_it_was(tmp_path, corpus_dir):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "config.toml").write_text("[train]\nlr = 0.1\n")  # the user's own config, not a run's
    (mine / "notes.txt").write_text("keep me")
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    proc = in_process("train", *sets(tiny_overrides(mine, corpus_dir)), check=False)
    assert proc.returncode == 2
    message = f"kiln: config error: run.dir: {mine} holds files but no kiln run (config.toml, notes.txt); choose"
    assert message in proc.stderr
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    # An empty directory, or a kiln run's own, is a run directory.
    empty = tmp_path / "empty"
    empty.mkdir()
    in_process("train", *sets(tiny_overrides(empty, corpus_dir, train__max_steps=2)))
    assert (empty / ".kiln-run").read_text() == f"kiln train (pid {os.getpid()} on {socket.gethostname()})\n"
    in_process("train", *sets(tiny_overrides(empty, corpus_dir, train__max_steps=4)))
