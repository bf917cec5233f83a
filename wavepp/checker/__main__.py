"""``python -m wavepp.checker pkg.mod:NAME``: check a policy against the protocol's invariants.

Runs the Hypothesis state machine of the admission protocol and the planner property
against the named policy, prints every invariant as held or VIOLATED and, for each
violation, the shrunk sequence of steps that breaks it. Exit status 1 on any violation,
2 when the policy cannot be loaded.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m wavepp.checker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("policy", help="'default' or pkg.mod:NAME naming a wavepp Policy")
    parser.add_argument("--max-examples", type=int, default=100,
                        help="Hypothesis examples per check (default 100)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=50,
                        help="steps per state-machine example (default 50)")  # fmt: skip
    parser.add_argument("--shrink-seconds", type=float, default=60,
                        help="most seconds spent shrinking one failure (default 60)")  # fmt: skip
    parser.add_argument("--derandomize", action="store_true",
                        help="a fixed example sequence (reproducible runs)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        print("wavepp.checker needs hypothesis: pip install 'hypothesis>=6.100'", file=sys.stderr)
        return 2
    from wavepp.checker.check import check_policy
    from wavepp.policy import PolicyError, load_policy

    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        print(f"wavepp.checker: {error}", file=sys.stderr)
        return 2
    report = check_policy(
        policy,
        name=args.policy,
        max_examples=args.max_examples,
        step_count=args.steps,
        derandomize=args.derandomize,
        shrink_seconds=args.shrink_seconds,
    )
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
