"""The package's layers, read from its source: every import (at the top of a module or inside a
function) goes from a higher layer to a lower one or stays within its own package, and no
modules import each other in a cycle."""

import ast
import traceback
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"

# Lower numbers are lower layers. A package may import its own modules and any package of a
# lower layer; packages of one layer stay independent of each other.
LAYERS = {
    "io": 0,
    "compat": 0,
    "labels": 0,
    "config": 1,
    "device": 2,
    "checkpoint": 3,
    "data": 3,
    "models": 3,
    "distributed": 4,
    "observe": 5,
    "harness": 5,
    "train": 6,
    "doctor": 7,
    "plan": 7,
    "export": 7,
    "serve": 7,
    "sweep": 7,
    "cli": 8,
    "__main__": 9,  # python -m kiln: runs the cli
}
LOWER = ("models", "data", "checkpoint", "distributed", "config")
UPPER = ("train", "doctor", "plan", "export", "serve", "sweep", "observe", "cli")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "kiln").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kiln modules ``module`` imports: ``from X import Y`` counts as X.Y where that is a
    module (a submodule import), else as X."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name in known and name != module}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # the root package re-exports lazily, by name


KNOWN = _modules()
GRAPH = {m: _imports(m, p, KNOWN) for m, p in KNOWN.items()}


def test_every_package_has_a_layer():
    assert {_layer(m) for m in GRAPH} - {None} == set(LAYERS)


def test_imports_go_down_the_layers():
    bad = []
    for module, imported in GRAPH.items():
        here = _layer(module)
        for target in imported:
            there = _layer(target)
            if here is None or there is None or here == there:
                continue
            if LAYERS[there] >= LAYERS[here]:
                bad.append(f"{module} ({here}, layer {LAYERS[here]}) imports {target} ({there}, layer {LAYERS[there]})")
    assert not bad, "\n".join(bad)
    assert all(LAYERS[low] < LAYERS[up] for low in LOWER for up in UPPER)


def test_no_import_cycles():
    """Tarjan's strongly connected components of the module graph: each must be one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checker_sees_a_violation():
    """The walk itself works: kiln.cli imports the train job, a lower layer would not."""
    assert "kiln.train.jobs.lm" in GRAPH["kiln.cli"]
    assert "kiln.config.schema" in GRAPH["kiln.config"]
    assert "kiln.doctor.data" in GRAPH["kiln.doctor.runner"]  # from kiln.doctor import data as ...


def test_loading_a_config_needs_no_torch():
    import subprocess
    import sys

    code = "import kiln.config as c; c.load_config(None, []); import sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_loop_does_not_branch_on_the_layout():
    """The step, the checkpointer, the optimizer's groups and the loop see a ParallelModel, never
    a pipeline (or any other layout) by name; the loop stays short enough to read in one go."""
    train = SRC / "kiln" / "train"
    for name in ("step.py", "checkpointer.py", "optim.py", "trainer.py", "after_step.py"):
        text = (train / name).read_text().lower()
        assert "pipeline" not in text, name
    source = (train / "trainer.py").read_text()
    assert len(source.splitlines()) <= 300
    (fit,) = (f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef) and f.name == "fit")
    assert fit.end_lineno - fit.lineno + 1 <= 40


def test_backward_is_three_calls_from_fit(tmp_path, monkeypatch):
    """A reader finds the backward pass from ``Trainer.fit`` in three calls: the step's
    forward-backward, the model's, and ``backward()`` itself (the memory ladder's retry wraps
    the first in a with block, no frame of its own)."""
    import torch

    from conftest import token_sequences, train_tiny_gpt

    stacks = []
    backward = torch.Tensor.backward

    def recorded(self, *args, **kwargs):
        stacks.append([frame.name for frame in traceback.extract_stack()])
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", recorded)
    train_tiny_gpt(tmp_path / "run", token_sequences(tmp_path), micro=2, global_=4, steps=2)
    assert len(stacks) == 4  # two steps of two micro-batches
    for names in stacks:
        between = names[len(names) - 1 - names[::-1].index("fit") + 1 : -1]  # the frames after fit's
        assert between == ["forward_backward", "forward_backward"], names


def test_no_behaviour_travels_through_the_environment():
    """Test faults come from the config's [debug] section, the sweep's hook from its trial command:
    no production module reads a KILN_TEST_ variable or an evaluation hook from the environment."""
    for path in (SRC / "kiln").rglob("*.py"):
        text = path.read_text()
        assert "KILN_TEST_" not in text and "KILN_EVALUATION_HOOK" not in text, path
