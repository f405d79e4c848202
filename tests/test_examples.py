import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_classifier_reaches_95_percent(tmp_path):
    acc = _load("digits").main(str(tmp_path / "digits"), console=False)
    assert acc >= 0.95
