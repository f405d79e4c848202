"""The search space: one TOML table per config key, checked against the config before any trial runs.

```toml
[train.lr]
type = "float"        # float | int | categorical
low = 1e-5
high = 3e-2
log = true
[train.schedule]
type = "categorical"
choices = ["cosine", "wsd"]
```

float and int take ``low``/``high`` (``log``, ``step``) or a list of ``choices``; categorical takes
``choices``. Every problem is reported at once, one line naming the space file and the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.config import ConfigError, all_keys, load_config, tomllib
from kiln.models.family import check_model_config

TYPES = ("float", "int", "categorical")
FIELDS = ("type", "low", "high", "log", "step", "choices")
# The sweep sets these for every trial itself.
RESERVED = ("run.dir", "checkpoint.resume")


@dataclass(frozen=True)
class Param:
    key: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] | None = None

    def suggest(self, trial, grid: bool = False) -> Any:
        """This parameter's value in an Optuna trial (drawn now, or the one it already has)."""
        if grid or self.choices is not None:
            return trial.suggest_categorical(self.key, self.grid())
        if self.type == "int":
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def grid(self) -> list[Any]:
        """Every value of the parameter, for the grid sampler: its choices, or low to high by step."""
        if self.choices is not None:
            return list(self.choices)
        step = self.step or 1  # only ints get here without a step (checked in load_space)
        assert self.low is not None and self.high is not None  # a range: no choices (_param)
        count = math.floor((self.high - self.low) / step + 1e-9) + 1
        values = [self.low + i * step for i in range(count)]
        return [int(v) for v in values] if self.type == "int" else [round(v, 12) for v in values]

    def describe(self) -> str:
        if self.choices is not None:
            return f"{self.key} in {list(self.choices)}"
        extra = (" log" if self.log else "") + (f" step {self.step}" if self.step else "")
        return f"{self.key} {self.type} [{self.low}, {self.high}]{extra}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "key" and v is not None}


def set_item(key: str, value: Any) -> str:
    """``key=value`` as ``--set`` takes it; floats by repr, so that they come back bit for bit."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = repr(value)
    else:
        text = str(value)
    return f"{key}={text}"


def grid_size(params: list[Param]) -> int:
    return math.prod(len(p.grid()) for p in params)


def load_space(path: str | Path, config: str | Path | None, overrides: list[str], *, grid: bool = False) -> list[Param]:
    """The parameters of the space file ``path``, each checked against the config built from
    ``config`` and ``overrides``: the key exists, and its bounds or choices are values it takes.
    Raises ConfigError listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: space file not found"])
    try:
        table = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError([f"{path}: not valid TOML: {e}"]) from None
    errors: list[str] = []
    params = []
    for key, spec in _tables(table):
        problems = [f"{path}: [{key}] {p}" for p in _spec_problems(key, spec, grid)]
        if not problems:
            param = _param(key, spec)
            problems = [f"{path}: [{key}] {p}" for p in _config_problems(param, config, overrides)]
            params.append(param)
        errors += problems
    if not errors and not params:
        errors.append(f'{path}: no parameters; add a table per config key, e.g. [train.lr] with type = "float"')
    if errors:
        raise ConfigError(errors)
    return params


def _tables(table: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, spec) for each table with a ``type``; anything else that is not a table of
    tables is returned as its own (bad) spec."""
    out = []
    for name, value in table.items():
        key = f"{prefix}{name}"
        section = isinstance(value, dict) and "type" not in value and value
        if section and all(isinstance(v, dict) for v in value.values()):
            out += _tables(value, f"{key}.")
        else:
            out.append((key, value))
    return out


def _spec_problems(key: str, spec: Any, grid: bool) -> list[str]:
    if not isinstance(spec, dict):
        return [f'is not a table; write [{key}] with type = "float", "int" or "categorical" and its range or choices']
    problems = [f"unknown field {name!r}; fields are {', '.join(FIELDS)}" for name in spec if name not in FIELDS]
    kind = spec.get("type")
    if kind not in TYPES:
        return [*problems, f"type {kind!r} is not one of {', '.join(TYPES)}"]
    if key in RESERVED:
        problems.append(f"{key} is set by the sweep for each trial; it cannot be searched")
    choices = spec.get("choices")
    if kind == "categorical" or choices is not None:
        return problems + _choice_problems(kind, spec, choices)
    low, high, step, log = spec.get("low"), spec.get("high"), spec.get("step"), spec.get("log", False)
    whole = int if kind == "int" else (int, float)
    if not (isinstance(low, whole) and isinstance(high, whole)) or isinstance(low, bool) or isinstance(high, bool):
        number = "an integer" if kind == "int" else "a number"
        return [*problems, f"{kind} needs low and high, each {number} (or a list of choices); got {low!r}, {high!r}"]
    if low >= high:
        problems.append(f"empty range: low {low} is not below high {high}")
    if not isinstance(log, bool):
        problems.append(f"log must be true or false, got {log!r}")
    elif log and low <= 0:
        problems.append(f"a log range needs low > 0, got {low}")
    if step is not None:
        if not isinstance(step, whole) or isinstance(step, bool) or step <= 0:
            problems.append(f"step must be a positive {'integer' if kind == 'int' else 'number'}, got {step!r}")
        elif log and (kind == "float" or step != 1):
            problems.append("log and step cannot be combined (a log range is continuous)")
    elif grid and kind == "float":
        problems.append("a grid needs a float's values: give choices = [...] or a step")
    return problems


def _choice_problems(kind: str, spec: dict[str, Any], choices: Any) -> list[str]:
    extra = [name for name in ("low", "high", "log", "step") if name in spec]
    problems = [f"choices and {', '.join(extra)} cannot be combined"] if extra else []
    if not isinstance(choices, list) or not choices:
        return [*problems, f"{kind} needs a non-empty list of choices, e.g. choices = [...]"]
    scalars: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float)}
    scalar = scalars.get(kind, (str, int, float, bool))
    problems += [
        f"choice {c!r} is not {'an integer' if kind == 'int' else 'a number' if kind == 'float' else 'a scalar'}"
        for c in choices
        if not isinstance(c, scalar) or (kind != "categorical" and isinstance(c, bool))
    ]
    # By type and value: true == 1 in Python, but a bool and an int choice are different values.
    keys = [(type(c).__name__, repr(c)) for c in choices]
    repeated = sorted({text for kind_, text in keys if keys.count((kind_, text)) > 1})
    if repeated:
        problems.append(f"choices repeat {', '.join(repeated)}")
    return problems


def _param(key: str, spec: dict[str, Any]) -> Param:
    kind = spec["type"]
    if spec.get("choices") is not None:
        coerce = float if kind == "float" else (lambda v: v)
        return Param(key, kind, choices=tuple(coerce(c) for c in spec["choices"]))
    number = int if kind == "int" else float
    step = spec.get("step")
    return Param(
        key,
        kind,
        low=number(spec["low"]),
        high=number(spec["high"]),
        log=spec.get("log", False),
        step=number(step) if step is not None else None,
    )


def _config_problems(param: Param, config: str | Path | None, overrides: list[str]) -> list[str]:
    """What the config says of this parameter's key and its extreme values: each is set alone on
    the base config, which must then load and describe a model its family can build."""
    if param.key not in all_keys():
        try:
            load_config(config, [*overrides, set_item(param.key, "")])
        except ConfigError as e:
            return [_about(param.key, e.errors[-1])]
    values = param.choices if param.choices is not None else (param.low, param.high)
    problems = []
    for name, value in zip(_value_names(param), values, strict=True):
        try:
            check_model_config(load_config(config, [*overrides, set_item(param.key, value)]))
        except ConfigError as e:
            problems += [f"{name} {value!r}: {_about(param.key, line)}" for line in e.errors]
    return problems


def _value_names(param: Param) -> list[str]:
    return ["choice"] * len(param.choices) if param.choices is not None else ["low", "high"]


def _about(key: str, line: str) -> str:
    """A config error about ``key``, without the prefix that says where the value came from."""
    return line.removeprefix("--set ").removeprefix(f"{key}: ")
