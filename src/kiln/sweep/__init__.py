"""``kiln sweep``: a hyperparameter search on Optuna whose trials are ordinary kiln runs.

space.py (the search space file, checked against the config), study.py (the study directory:
Optuna's journal storage, the setup, file locks), driver.py (running trials as subprocesses,
reporting their evaluations, pruning, taking over trials left running), results.py (trials.csv,
best.toml, sweep.png, the console table) and command.py (the command's options, ``sweep``).
Optuna is imported only when a sweep runs (``pip install 'kiln[sweep]'``).
"""

from kiln.sweep.command import SweepResult, add_arguments, sweep, sweep_command

__all__ = ["SweepResult", "add_arguments", "sweep", "sweep_command"]
