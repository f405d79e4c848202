"""Building a Config: defaults, then a TOML file, then ``--set section.key=value`` overrides, then validation.

Values are coerced to each field's annotated type here, so a wrong type is reported with the key that holds it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from kiln.config.schema import Config, ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# `Union[a, b]` and `a | b`: the second is a types.UnionType unless an operand is a typing form.
_UNIONS = (Union, types.UnionType)


def sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _type_name(tp: Any) -> str:
    if get_origin(tp) in _UNIONS:
        return " or ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, tp: Any, value: Any, from_text: bool) -> Any:
    """Turn ``value`` into type ``tp`` or raise ConfigError naming ``key``."""
    if get_origin(tp) is tuple and dataclasses.is_dataclass(get_args(tp)[0]):
        return _tables(key, get_args(tp)[0], value, from_text)
    if get_origin(tp) is tuple and get_args(tp) == (str, Ellipsis):
        return _strings(key, value, from_text)
    if get_origin(tp) is tuple and get_args(tp) in ((int, Ellipsis), (float, Ellipsis)):
        return _numbers(key, get_args(tp)[0], value, from_text)
    if get_origin(tp) in _UNIONS:
        for option in get_args(tp):
            try:
                return _coerce(key, option, value, from_text)
            except ConfigError:
                pass
        raise ConfigError([f"{key}: expected {_type_name(tp)}, got {value!r}"])
    if get_origin(tp) is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError([f"{key}: {value!r} is not allowed; choose one of {', '.join(map(str, allowed))}"])
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return str(value).lower() in ("true", "1", "yes", "on")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(str(value).replace("_", ""))
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if from_text:
            return str(value)
    raise ConfigError([f"{key}: expected {_type_name(tp)}, got {value!r}"])


def _strings(key: str, value: Any, from_text: bool) -> tuple[str, ...]:
    """A list of strings: a TOML array, or on the command line also ``a,b,c``."""
    if from_text and isinstance(value, str):
        if value.strip().startswith("["):
            try:
                value = tomllib.loads(f"value = {value}")["value"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError([f"{key}: not a TOML array of strings ({e}): {value!r}"]) from None
        else:
            value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError([f"{key}: expected a list of strings, got {value!r}"])


def _numbers(key: str, tp: type, value: Any, from_text: bool) -> tuple:
    """A list of integers or numbers: a TOML array, or on the command line also ``3,4,4,3``."""
    if from_text and isinstance(value, str):
        value = [part.strip(" []") for part in value.split(",") if part.strip(" []")]
    if isinstance(value, list | tuple):
        try:
            return tuple(_coerce(key, tp, v, from_text) for v in value)
        except ConfigError:
            pass
    raise ConfigError([f"{key}: expected a list of {'integers' if tp is int else 'numbers'}, got {value!r}"])


def _tables(key: str, cls: Any, value: Any, from_text: bool) -> tuple:
    """A list of tables (``[[section.key]]`` in TOML, or an inline array of them on the command
    line: ``[{a = 1}, {a = 2}]``) as a tuple of ``cls``, each field coerced, errors naming
    ``key[i].field``."""
    if from_text:
        try:
            value = tomllib.loads(f"value = {value}")["value"]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(
                [f"{key}: expected a TOML array of tables, [{{key = value}}, ...], got {value!r} ({e})"]
            ) from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError([f"{key}: expected a list of tables, got {value!r}"])
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [name for name, f in fields.items() if f.default is dataclasses.MISSING]
    errors, out = [], []
    for i, table in enumerate(value):
        where = f"{key}[{i}]"
        errors += [f"{where}.{k}: unknown key; keys are {', '.join(fields)}" for k in table if k not in fields]
        errors += [f"{where}: needs {name} = ..." for name in required if name not in table]
        coerced = {}
        for k, v in table.items():
            if k in fields:
                try:
                    coerced[k] = _coerce(f"{where}.{k}", hints[k], v, False)
                except ConfigError as e:
                    errors += e.errors
        if not errors:
            out.append(cls(**coerced))
    if errors:
        raise ConfigError(errors)
    return tuple(out)


def _unknown_key(key: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(key, known, n=1)
    msg = f"{key}: unknown config key"
    if hint:
        msg += f"; did you mean {hint[0]}?"
    section = key.split(".")[0]
    same = [k for k in known if k.startswith(section + ".")]
    if same and not hint:
        msg += f"; keys in [{section}]: {', '.join(same)}"
    elif not same:
        msg += f"; sections are {', '.join(sections())}"
    return msg


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in sections().items() for f in dataclasses.fields(cls)]


def _apply(values: dict[str, dict[str, Any]], pairs: list[tuple[str, Any, bool]], origin: str) -> list[str]:
    """Set ``(dotted key, value, from_text)`` pairs into the nested ``values`` dict."""
    errors = []
    known = all_keys()
    secs = sections()
    for key, value, from_text in pairs:
        if retired := _retired(key, value):
            errors.append(origin + retired)
            continue
        if key not in known:
            errors.append(origin + _unknown_key(key, known))
            continue
        section, name = key.split(".", 1)
        tp = typing.get_type_hints(secs[section])[name]
        try:
            values[section][name] = _coerce(key, tp, value, from_text)
        except ConfigError as e:
            errors.extend(origin + line for line in e.errors)
    return errors


def _flatten(table: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in table.items():
        if isinstance(v, dict):
            out.extend(_flatten(v, f"{prefix}{k}."))
        else:
            out.append((f"{prefix}{k}", v))
    return out


def parse_set(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=3e-4"])
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- ``--set`` overrides, then validation. Raises ConfigError."""
    values = Config().to_dict()
    errors: list[str] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"{p}: config file not found"])
        try:
            table = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError([f"{p}: not valid TOML: {e}"]) from None
        errors += _apply(values, [(k, v, False) for k, v in _flatten(table)], f"{p}: ")
    pairs = []
    for item in overrides or []:
        try:
            pairs.append((*parse_set(item), True))
        except ConfigError as e:
            errors += e.errors
    errors += _apply(values, pairs, "--set ")
    if errors:
        raise ConfigError(errors)
    secs = sections()
    cfg = Config(**{s: secs[s](**v) for s, v in values.items()})
    validate(cfg)
    return cfg


def from_dict(values: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config saved with ``to_dict`` (e.g. from a checkpoint), ignoring unknown keys;
    one saved by an earlier kiln is read as it would be written now."""
    values = _upgraded(values)
    secs = sections()
    known = {s: {f.name for f in dataclasses.fields(cls)} for s, cls in secs.items()}
    return Config(**{s: secs[s](**{k: v for k, v in values.get(s, {}).items() if k in known[s]}) for s in secs})


def _upgraded(values: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A saved config in today's keys: earlier versions said run.job = "finetune" and what it
    trained for in train.objective, which is the run's job now; grpo.length_norm is grpo.loss."""
    run, train = dict(values.get("run", {})), dict(values.get("train", {}))
    objective = train.pop("objective", "sft")
    if run.get("job") == "finetune":
        classify = values.get("model", {}).get("task") == "sequence_classification"
        run["job"] = objective if objective != "sft" else "classify" if classify else "sft"
    grpo = dict(values.get("grpo", {}))
    if "length_norm" in grpo:  # grpo.loss since issue 52
        grpo["loss"] = {"sequence": "grpo"}.get(grpo.pop("length_norm"), "dr_grpo")
    return {**values, "run": run, "train": train, "grpo": grpo}


def _retired(key: str, value: Any) -> str | None:
    """Why a key or value of an earlier kiln is refused, and what says it now."""
    if key == "train.objective":
        job = "sft (classify for a sequence classifier)" if value == "sft" else repr(value)
        return f"train.objective: what a run trains for is its run.job now; set run.job = {job} instead"
    if key == "grpo.length_norm":
        loss = "grpo" if value == "sequence" else value
        return f"grpo.length_norm: how token losses become the loss is grpo.loss now; set grpo.loss = {loss!r}"
    if key == "run.job" and value == "finetune":
        return (
            "run.job: finetune is sft now (a causal LM on prompt/completion or chat records), or classify (a "
            "sequence classifier on labelled text); a preference objective or grpo is the run.job itself"
        )
    return None


def validate(cfg: Config) -> None:
    """Check values that a type alone cannot; collect every problem, then raise once."""
    errors = cfg.errors()
    if errors:
        raise ConfigError(errors)
