"""The bar shown while a large model's weights are loaded or initialised."""

import contextlib
import io
import sys

from kiln.models import GPT, GPTConfig
from kiln.models.init import Initial, params_on_meta
from kiln.observe.progress import counted


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_filling_a_model_counts_each_tensor_once():
    with params_on_meta():
        model = GPT(
            GPTConfig(
                vocab_size=97,
                n_layer=2,
                d_model=32,
                n_head=4,
                n_kv_head=4,
                d_ff=64,
                max_seq_len=64,
                tie_embeddings=True,
            )
        )
    initial = Initial(model, seed=0)
    counts: list[tuple[str, int, int]] = []

    @contextlib.contextmanager
    def progress(what, total):
        done = [0]
        yield lambda: done.__setitem__(0, done[0] + 1)
        counts.append((what, total, done[0]))

    initial.progress = progress
    initial.materialize(model, "cpu")
    tensors = len(list(model.named_parameters()) + list(model.named_buffers()))
    assert counts == [("initialising weights", tensors, tensors)]


def test_the_bar_shows_on_a_terminal_only(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    with counted("loading weights", 20) as advance:
        for _ in range(20):
            advance()
    assert "loading weights" in terminal.getvalue() and "20/20" in terminal.getvalue()
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stdout", plain)
    with counted("loading weights", 20) as advance:
        advance()
    assert plain.getvalue() == ""


def test_the_eta_does_not_count_the_setup_before_the_first_step(tmp_path):
    """A time plan's probe, loading or compiling before step 1 is not the steps' pace."""
    import time

    from kiln.observe.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, total_steps=100, console=False, tensorboard=False)
    time.sleep(1.2)  # the setup: at its pace the 90 steps left would take 10 s more
    for step in range(1, 11):
        logger.step_done(step)
    assert "ETA 0s" in logger._console_line(10, {"loss": 1.0})


def test_the_eta_follows_the_pace_after_a_pause_between_steps(tmp_path):
    """A compile after the first steps (train.compile_after) is a long pause between two log
    lines: the average over the run would stretch the ETA for a long while, the last interval's
    pace does not."""
    import time

    from kiln.observe.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, total_steps=1000, console=False, tensorboard=False)
    for step in range(1, 21):
        logger.step_done(step)
    logger._console_line(20, {"loss": 1.0})
    time.sleep(1.0)  # the compile, between step 20 and step 21
    logger.step_done(21)
    paused = logger._console_line(21, {"loss": 1.0})
    assert "ETA 0s" not in paused  # that interval was slow
    for step in range(22, 41):
        logger.step_done(step)
    assert "ETA 0s" in logger._console_line(40, {"loss": 1.0})  # at the pace since
