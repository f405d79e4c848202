"""What ``kiln doctor`` reports: one row per check, rendered as a console table or as JSON."""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import asdict, dataclass, field

# A check that does not apply here (no GPU, no validation set, ...) is "skip", so that "pass"
# always means something was looked at and found fine.
STATUSES = ("pass", "warn", "fail", "skip")
GROUPS = ("environment", "data", "model", "pipeline", "determinism")


@dataclass
class Check:
    name: str
    group: str
    status: str
    evidence: str
    """What was measured, with the numbers."""
    fix: str = ""
    """What to do about a warn or fail, in words a user can act on."""
    seconds: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {self.group!r}")


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    @property
    def status(self) -> str:
        """The worst status of any check: fail, else warn, else pass."""
        found = {c.status for c in self.checks}
        return "fail" if "fail" in found else "warn" if "warn" in found else "pass"

    @property
    def exit_status(self) -> int:
        """0 unless a check failed (warnings do not stop a run)."""
        return 1 if self.status == "fail" else 0

    def get(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"no check named {name!r}; checks: {', '.join(c.name for c in self.checks)}")

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "exit_status": self.exit_status,
            "counts": self.counts(),
            "seconds": round(self.seconds, 2),
            "checks": [asdict(c) for c in self.checks],
        }

    def render(self, width: int | None = None) -> str:
        """A console table grouped by area; each warn or fail is followed by its fix."""
        width = width or max(80, min(120, shutil.get_terminal_size((100, 24)).columns))
        name_w = max((len(c.name) for c in self.checks), default=0)
        indent = 2 + 4 + 2 + name_w + 2  # "  " status "  " name "  "
        wrap = textwrap.TextWrapper(width=width, subsequent_indent=" " * indent, break_on_hyphens=False)
        lines = []
        for group in GROUPS:
            rows = [c for c in self.checks if c.group == group]
            if not rows:
                continue
            lines.append(group.upper())
            for c in rows:
                lines.append(wrap.fill(f"  {c.status:<4}  {c.name:<{name_w}}  {c.evidence}"))
                if c.fix and c.status in ("warn", "fail"):
                    lines.append(wrap.fill(f"{'':{indent - 5}}fix: {c.fix}"))
        counts = self.counts()
        verdict = {
            "fail": "some checks FAILED; see the fixes above",
            "warn": "no failures, some warnings",
            "pass": "all clear",
        }[self.status]
        lines.append(
            f"\n{counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} skipped "
            f"in {self.seconds:.1f}s: {verdict}"
        )
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def first_line(e: BaseException) -> str:
    """An exception's first line of message (at most 300 characters), for the evidence."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
