"""Benchmark evaluation with EleutherAI's lm-evaluation-harness (the ``kiln[eval]`` extra):
kiln's model as an lm-eval language model (``kiln.harness.model``, imported only when tasks are
asked for) and the tasks it is scored on (``kiln.harness.tasks``)."""

from kiln.harness.tasks import TaskError, check_tasks, run_tasks, scores, table, task_manager, write_results

__all__ = ["TaskError", "check_tasks", "run_tasks", "scores", "table", "task_manager", "write_results"]
