"""``kiln plan``: memory per device and time per step of a config before anything is allocated
(estimate.py), what to change when it does not fit (recommend.py), the plan itself
(planner.py) and its table and JSON (format.py)."""

from kiln.plan.estimate import ModelShape, Setup, model_state
from kiln.plan.format import format_plan, plan_json
from kiln.plan.planner import Plan, make_plan, parse_memory

__all__ = ["ModelShape", "Plan", "Setup", "format_plan", "make_plan", "model_state", "parse_memory", "plan_json"]
