"""``kiln doctor``: preflight checks of a config before a long run. What they examine, the
subject (job.py), the checks by area (environment.py, data.py, model.py: model, input pipeline and
determinism), running them (runner.py) and the report (report.py)."""

from kiln.doctor.report import Check, DoctorReport
from kiln.doctor.runner import doctor_command, run_doctor

__all__ = ["Check", "DoctorReport", "doctor_command", "run_doctor"]
