"""Run the property suite against one policy and say which invariants held."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
from hypothesis import HealthCheck, Phase, settings
from hypothesis.internal.conjecture import engine as _engine
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from wavepp.checker.invariants import INVARIANTS, Violation
from wavepp.checker.machines import admission_machine
from wavepp.checker.planners import planner_property
from wavepp.plan import PLANNERS
from wavepp.policy import Policy

PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)
"""No ``explain`` phase: it traces every line and makes shrinking minutes slower."""


@attrs.frozen
class Finding:
    """One broken invariant: what broke and the shrunk steps that break it."""

    invariant: str  # a key of INVARIANTS
    detail: str
    steps: tuple[str, ...]  # Hypothesis's minimal failing example, one line a step
    where: str  # "admission machine" or "planner <name>"


@attrs.frozen
class Report:
    policy: str
    max_examples: int
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    def violated(self) -> set[str]:
        return {f.invariant for f in self.findings}

    def render(self) -> str:
        lines = [f"policy {self.policy}: {self.max_examples} examples per check"]
        broken = self.violated()
        for name, text in INVARIANTS.items():
            state = "VIOLATED" if name in broken else "held"
            lines.append(f"  {state:<8}  {name}: {text}")
        for finding in self.findings:
            lines.append("")
            lines.append(f"{finding.invariant} violated in the {finding.where}:")
            lines.append(f"  {finding.detail}")
            if finding.steps:
                lines.append("  shrunk steps:")
                lines.extend(f"    {step}" for step in finding.steps)
        lines.append("")
        if self.ok:
            lines.append("all invariants held")
        else:
            lines.append(
                f"{len(broken)} invariant(s) violated. Each check stops at its first "
                "violation, so an invariant shown held was not violated before that."
            )
        return "\n".join(lines)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


_CHECK_CALL = re.compile(r"^\s*state\.(?!teardown)\w+\(\)$")  # an invariant's check, not a step


def _findings(error: BaseException, where: str, notes: list[str]) -> list[Finding]:
    if any("shrink" in note for note in notes):
        where += " (shrinking hit its time limit: the steps may not be minimal)"
    out = []
    for leaf in _leaves(error):
        steps = tuple(
            line
            for note in getattr(leaf, "__notes__", ())
            for line in str(note).splitlines()
            if line.strip() and not _CHECK_CALL.match(line)
        )
        if isinstance(leaf, Violation):
            detail = str(leaf.args[0]) if leaf.args else ""
            out.append(Finding(leaf.invariant, detail, steps, where))
        else:
            detail = f"{type(leaf).__name__}: {leaf}"
            # An error outside any checked step (the policy broke the machine itself).
            out.append(Finding("no_unexpected_error", detail, steps, where))
    return out


@contextmanager
def _shrink_budget(seconds: float, notes: list[str]) -> Iterator[None]:
    """Bound Hypothesis's shrinking time (its own limit is five minutes a failure) and
    keep its messages instead of printing them."""
    saved = getattr(_engine, "MAX_SHRINKING_SECONDS", None)
    if saved is not None:
        _engine.MAX_SHRINKING_SECONDS = seconds
    try:
        with with_reporter(lambda message: notes.append(str(message))):
            yield
    finally:
        if saved is not None:
            _engine.MAX_SHRINKING_SECONDS = saved


def check_policy(
    policy: Policy,
    *,
    name: str | None = None,
    max_examples: int = 100,
    step_count: int = 50,
    derandomize: bool = False,
    shrink_seconds: float = 60.0,
) -> Report:
    """Run the admission machine and the planner property against ``policy``.

    The planner checked is the policy's own, or every built-in one the rungs use when
    the policy leaves the planner to the rung.
    """
    findings: list[Finding] = []
    machine = admission_machine(policy)
    machine_settings = settings(
        max_examples=max_examples,
        stateful_step_count=step_count,
        deadline=None,
        database=None,
        derandomize=derandomize,
        report_multiple_bugs=False,
        phases=PHASES,  # one bug, shrunk: minutes less on a broken policy
        suppress_health_check=list(HealthCheck),
    )
    notes: list[str] = []
    with _shrink_budget(shrink_seconds, notes):
        try:
            run_state_machine_as_test(machine, settings=machine_settings)
        except Exception as error:
            findings.extend(_findings(error, "admission machine", notes))
        planners = {"own": policy.planner} if policy.planner is not None else dict(PLANNERS)
        for label, planner in planners.items():
            notes.clear()
            test = planner_property(planner, max_examples, derandomize)
            try:
                test()
            except Exception as error:
                findings.extend(_findings(error, f"planner {label}", notes))
    return Report(name or policy.name, max_examples, tuple(findings))
