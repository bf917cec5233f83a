"""The checker (``python -m wavepp.checker``) passes every working example policy and
rejects each broken one, naming the invariant it breaks.

A broken policy is caught by construction: the checker's state machine replays a fixed
sequence of steps that breaks the invariant (a shrunk search's steps, written out), so
the verdict does not depend on what a search happens to draw. A random search may not
reach a bug within its examples, may stop first at another invariant the same bug
breaks, and draws differently after other modules were imported (Hypothesis mixes the
constants of every loaded module into its choices). The searches run too, as secondary
checks whose assertions hold whatever they draw, and the CLI's in a fresh process.
"""

import inspect
import os
import subprocess
import sys
from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.stateful import INVARIANT_MARKER, RuleBasedStateMachine

from wavepp.checker import INVARIANTS, Finding, Report, Violation, admission_machine, check_policy
from wavepp.policy import DEFAULT, Policy, load_policy

WORKING = ["lfu", "recompute_cost", "smallest_fit", "fair_share", "interval_only", "counting"]
BROKEN = {
    "broken_evicts_leased": "leased_block_never_evicted",
    "broken_escrow_double_count": "escrow_backed",
}


def policy(name: str) -> Policy:
    return load_policy(f"examples.policies.{name}:POLICY")


def check(name: str, max_examples: int):
    return check_policy(
        policy(name), max_examples=max_examples, step_count=30, derandomize=True, shrink_seconds=10
    )


@pytest.mark.parametrize("name", WORKING)
def test_checker_passes_a_working_policy(name):
    report = check(name, 30)
    assert report.ok, report.render()


# -- the broken policies, by construction -----------------------------------------------


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    """Tokens as the machine's prompts draw them: 4-token blocks of one value, then 9s."""
    return [t for b in blocks for t in [b] * 4] + [9] * tail


class Chosen:
    """Hypothesis's ``data`` argument of a rule, replayed: each draw returns the next
    value given (a live request, a (request, stage) pair, an earlier prompt)."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object, label: object = None) -> object:
        return self.values.pop(0)


class Replay:
    """Runs rules of the admission machine in a fixed order, checking every invariant
    after each step as Hypothesis does."""

    def __init__(self, machine: RuleBasedStateMachine) -> None:
        self.machine = machine
        self.invariants = [
            f for _, f in inspect.getmembers(type(machine)) if getattr(f, INVARIANT_MARKER, None)
        ]

    def __call__(self, rule: str, **arguments: object) -> None:
        getattr(self.machine, rule)(**arguments)
        for invariant in self.invariants:
            invariant(self.machine)

    def live(self, request_id: str) -> object:
        return self.machine.live[request_id]


def evicts_leased(step: Replay) -> None:
    """Two stages of 6 blocks filled by a 5-block document and a 1-block one, then a
    6-block prompt leasing the document's first 2 blocks: its 4 new blocks are backed by
    the 3 unleased ones of the document and the other document's block. Evicting the
    largest tail first and ignoring pins, materialization takes the document's 3-block
    tail and then its leased head."""
    step("setup", capacities=[6, 6], recurrent=[False] * 4, snapshot_pools=[None] * 4,
         eager=False)  # fmt: skip
    step("admit_new", batch=[prompt(0, 0, 0, 0, 0)])
    step("complete", data=Chosen(step.live("r0")))
    step("admit_new", batch=[prompt(1)])
    step("complete", data=Chosen(step.live("r1")))
    step("admit_new", batch=[prompt(0, 0, 1, 1, 1, 1)])
    step("materialize_one_stage", data=Chosen((step.live("r2"), 0)))


def escrow_double_count(step: Replay) -> None:
    """Eager stages of 6 blocks: a 3-block prompt takes 3 slots at admission, then its
    follow-up turn (the same blocks, nothing cached yet) asks 4. Only 3 slots back it;
    an escrow that forgets the allocated slots counts 6."""
    step("setup", capacities=[6, 6], recurrent=[False] * 4, snapshot_pools=[None] * 4,
         eager=True)  # fmt: skip
    step("admit_new", batch=[prompt(0, 0, 0)])
    step("admit_extension", data=Chosen(prompt(0, 0, 0)), more=[])


SCENARIOS: dict[str, Callable[[Replay], None]] = {
    "broken_evicts_leased": evicts_leased,
    "broken_escrow_double_count": escrow_double_count,
}


def replay(subject: Policy, scenario: Callable[[Replay], None]) -> None:
    """Run ``scenario`` on the admission machine of ``subject``, inside a Hypothesis test
    (the machine's rules record events) that draws nothing."""

    @settings(max_examples=1, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.just(None))
    def run(_: None) -> None:
        scenario(Replay(admission_machine(subject)()))

    run()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_policy_breaks_the_named_invariant_in_its_scenario(name):
    with pytest.raises(Violation) as caught:
        replay(policy(name), SCENARIOS[name])
    assert caught.value.invariant == BROKEN[name], caught.value
    finding = Finding(caught.value.invariant, caught.value.args[0], (), "admission machine")
    rendered = Report(name, 0, (finding,)).render()
    assert f"VIOLATED  {BROKEN[name]}: {INVARIANTS[BROKEN[name]]}" in rendered


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("name", ["default", *WORKING])
def test_the_scenarios_are_valid_runs_that_working_policies_pass(name, scenario):
    """The scenarios break the broken policies, not the protocol: the default and every
    working policy run them without a violation."""
    replay(DEFAULT if name == "default" else policy(name), SCENARIOS[scenario])


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_search_of_a_broken_policy_blames_its_admission_machine_only(name):
    # Secondary: whether 100 examples reach the bug, and which of the state's invariants
    # it breaks they meet first, depends on the draws. These policies leave the planner
    # to the rungs, so whatever the search finds is in the admission machine, with the
    # shrunk steps that reach it.
    report = check(name, 100)
    for finding in report.findings:
        assert finding.where.startswith("admission machine"), report.render()
        assert any(step.startswith("state.setup(") for step in finding.steps), finding.steps


# -- the command line -------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # A fresh process with a fixed hash seed: a derandomized search draws the same
    # examples every run, whatever this process imported.
    return subprocess.run(
        [sys.executable, "-m", "wavepp.checker", *args, "--derandomize", "--shrink-seconds", "10"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONHASHSEED": "0"},
    )  # fmt: skip


def test_cli_exits_non_zero_and_prints_the_shrunk_steps_of_a_violation():
    # In 60 random searches this bug broke escrow_backed, first, within 4 to 58 examples:
    # 300 leave a wide margin for whatever stream a later change of the code gives
    # (a search stops at its first violation, so the margin costs nothing).
    done = run_cli("examples.policies.broken_escrow_double_count:POLICY", "--max-examples", "300")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "VIOLATED  escrow_backed" in done.stdout
    assert "shrunk steps:" in done.stdout and "state.admit_new(" in done.stdout
    assert "held      leased_block_never_evicted" in done.stdout


def test_cli_exits_zero_for_a_working_policy_and_two_for_a_bad_name():
    done = run_cli("examples.policies.lfu:POLICY", "--max-examples", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all invariants held" in done.stdout
    bad = run_cli("examples.policies.lfu:MISSING")
    assert bad.returncode == 2 and "has no 'MISSING'" in bad.stderr
