"""The search space file: what it accepts, and one clear line per problem before any trial runs."""

import sys
from pathlib import Path

import pytest

from kiln.config import ConfigError
from kiln.sweep.space import Param, load_space
from kiln.sweep.study import import_optuna

from kilnrun import kiln


def _space(tmp_path, text: str) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(text)
    return path


def test_every_kind_of_parameter(tmp_path):
    space = _space(
        tmp_path,
        """
        [train.lr]
        type = "float"
        low = 1e-5
        high = 3e-2
        log = true
        [train.schedule]
        type = "categorical"
        choices = ["cosine", "wsd"]
        [train]
        warmup_steps = { type = "int", low = 0, high = 40, step = 10 }
        ["train.weight_decay"]
        type = "float"
        low = 0.0
        high = 0.2
        step = 0.05
        [model.n_layer]
        type = "int"
        choices = [2, 4]
        """,
    )
    params = load_space(space, None, [])
    assert params == [
        Param("train.lr", "float", low=1e-5, high=3e-2, log=True),
        Param("train.schedule", "categorical", choices=("cosine", "wsd")),
        Param("train.warmup_steps", "int", low=0, high=40, step=10),
        Param("train.weight_decay", "float", low=0.0, high=0.2, step=0.05),
        Param("model.n_layer", "int", choices=(2, 4)),
    ]
    # What a grid goes through (a log-scale float has no grid: it needs choices or a step).
    grids = [p.grid() for p in params[1:]]
    assert grids == [["cosine", "wsd"], [0, 10, 20, 30, 40], [0.0, 0.05, 0.1, 0.15, 0.2], [2, 4]]


@pytest.mark.parametrize(
    "text, message",
    [
        ("train.lrr = {type = 'float', low = 1e-4, high = 1e-2}", "[train.lrr] unknown config key; did you mean"),
        ("train.lr = {type = 'float', low = 3e-2, high = 1e-5}", "[train.lr] empty range: low 0.03 is not below"),
        ("train.lr = {type = 'float', low = 1e-3, high = 1e-3}", "[train.lr] empty range: low 0.001 is not below high"),
        ("train.schedule = {type = 'categorical', choices = []}", "categorical needs a non-empty list"),
        ("train.schedule = {type = 'categorical'}", "[train.schedule] categorical needs a non-empty list of choices"),
        ("train.lr = {type = 'double', low = 1e-4, high = 1e-2}", "[train.lr] type 'double' is not one of float, int"),
        ("train.lr = {low = 1e-4, high = 1e-2}", "[train.lr] type None is not one of float, int, categorical"),
        ("train.lr = {type = 'float', low = -1.0, high = 1e-2}", "[train.lr] low -1.0: must be > 0, got -1.0"),
        ("train.lr = {type = 'float', low = 0.0, high = 1.0, log = true}", "[train.lr] a log range needs low > 0"),
        ("model.n_layer = {type = 'int', low = 1.5, high = 4}", "[model.n_layer] int needs low and high, each"),
        ("model.n_layer = {type = 'float', low = 1.0, high = 4.0}", "[model.n_layer] low 1.0: expected an integer"),
        ("train.schedule = {type = 'categorical', choices = ['wsd', 'cosin']}", "choice 'cosin': 'cosin' is not"),
        ("train.lr = {type = 'float', low = 1e-4, high = 1e-2, setp = 1e-4}", "[train.lr] unknown field 'setp'"),
        ("run.dir = {type = 'categorical', choices = ['a', 'b']}", "[run.dir] run.dir is set by the sweep"),
        ("train.lr = {type = 'float', low = 1e-4, high = 1e-2}", "[train.lr] a grid needs a float's values"),
        ("lr = 3", "[lr] is not a table"),
        ("", "no parameters"),
    ],
)
def test_a_bad_space_is_refused_naming_the_file_and_key(tmp_path, text, message):
    space = _space(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_space(space, None, [], grid="grid" in message)
    assert all(line.startswith(f"{space}: ") for line in e.value.errors), e.value.errors
    assert message in e.value.errors[0], e.value.errors


def test_values_are_checked_against_the_base_config(tmp_path):
    """A model dimension that the family cannot build with the rest of the config is refused."""
    space = _space(tmp_path, "[model.n_head]\ntype = 'int'\nlow = 3\nhigh = 4")
    with pytest.raises(ConfigError) as e:
        load_space(space, None, ["model.d_model=64"])
    assert e.value.errors[0].startswith(f"{space}: [model.n_head] low 3: ")


def test_without_optuna_the_sweep_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now fails
    with pytest.raises(ConfigError, match=r"pip install 'kiln\[sweep\]'"):
        import_optuna()


def test_the_command_refuses_a_bad_space_with_exit_2_and_writes_nothing(tmp_path):
    pytest.importorskip("optuna")
    space = _space(
        tmp_path,
        "[train.lrr]\ntype = 'float'\nlow = 1e-4\nhigh = 1e-2\n[train.schedule]\ntype = 'categorical'\nchoices = []\n",
    )
    study = tmp_path / "study"
    proc = kiln("sweep", "--space", space, "--study-dir", study, "--trials", "2", check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"kiln: config error: {space}: [train.lrr] unknown config key; did you mean train.lr?",
        f"kiln: config error: {space}: [train.schedule] categorical needs a non-empty list of choices, "
        "e.g. choices = [...]",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["space.toml"]
