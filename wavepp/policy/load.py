"""Selecting a policy: ``--policy pkg.mod:NAME`` and single-field overrides.

``--planner``, ``--probe`` and ``--eviction`` replace one field of the policy in use;
each takes a built-in name or a dotted path ``pkg.mod:NAME``.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from wavepp import state
from wavepp.plan import PLANNERS
from wavepp.policy.record import DEFAULT, EDF, Policy
from wavepp.state import LRU, Eviction, Guarantee, guarantees_of

POLICIES: dict[str, Policy] = {"default": DEFAULT, "edf": EDF}
PROBES = {"gallop": state.probe, "linear": state.probe_linear}
EVICTIONS: dict[str, Eviction] = {"lru": LRU}


class PolicyError(ValueError):
    """A policy (or one of its fields) named on the command line cannot be used."""


def resolve(dotted: str) -> Any:
    """``pkg.mod:name`` (or ``pkg.mod.name``) to the object it names."""
    if ":" in dotted:
        module, _, name = dotted.partition(":")
    else:
        module, _, name = dotted.rpartition(".")
    if not module or not name:
        raise PolicyError(f"{dotted!r} is not a dotted path pkg.mod:NAME")
    try:
        target = importlib.import_module(module)
    except ImportError as error:
        raise PolicyError(f"cannot import {module!r} for {dotted!r}: {error}") from None
    try:
        return getattr(target, name)
    except AttributeError:
        raise PolicyError(f"module {module!r} has no {name!r} (from {dotted!r})") from None


def _named(kind: str, spec: str, builtin: dict[str, Any]) -> Any:
    if spec in builtin:
        return builtin[spec]
    if ":" not in spec and "." not in spec:
        raise PolicyError(
            f"{kind} {spec!r} is not built in ({', '.join(sorted(builtin))}) nor a dotted path"
        )
    return resolve(spec)


def load_policy(spec: str) -> Policy:
    """``default`` or ``pkg.mod:NAME`` naming a :class:`Policy`."""
    policy = _named("policy", spec, POLICIES)
    if not isinstance(policy, Policy):
        raise PolicyError(f"{spec!r} names a {type(policy).__name__}, not a wavepp Policy")
    return policy


def resolve_planner(spec: str):
    planner = _named("planner", spec, PLANNERS)
    if not callable(planner):
        raise PolicyError(f"planner {spec!r} is not callable")
    return planner


def resolve_probe(spec: str):
    probe = _named("probe", spec, PROBES)
    if not callable(probe):
        raise PolicyError(f"probe {spec!r} is not callable")
    return probe


def resolve_eviction(spec: str) -> Eviction:
    eviction = _named("eviction", spec, EVICTIONS)
    if not isinstance(eviction, Eviction):
        raise PolicyError(f"eviction {spec!r} is a {type(eviction).__name__}, not an Eviction")
    return eviction


def with_overrides(
    policy: Policy,
    *,
    planner: str | None = None,
    probe: str | None = None,
    eviction: str | None = None,
) -> Policy:
    """The policy with the fields named on the command line replaced."""
    changes: dict[str, Any] = {}
    if planner:
        changes["planner"] = resolve_planner(planner)
    if probe:
        changes["probe"] = resolve_probe(probe)
    if eviction:
        changes["eviction"] = resolve_eviction(eviction)
    return attrs.evolve(policy, **changes) if changes else policy


def for_rung(policy: Policy, *, linear_probe: bool, planner: str) -> Policy:
    """Fill what the rung decides and the policy leaves open.

    R1's linear walk replaces the probe where the policy's probe declares itself a
    plain walk (``Guarantee.PLAIN_PROBE``: the default one, or a wrapper that only
    observes it); the rung's planner (``static``, ``mpu`` or ``cost``) is used where
    the policy names none.
    """
    changes: dict[str, Any] = {}
    if linear_probe and Guarantee.PLAIN_PROBE in guarantees_of(policy.probe):
        changes["probe"] = state.probe_linear
    if policy.planner is None:
        changes["planner"] = resolve_planner(planner)
    return attrs.evolve(policy, **changes) if changes else policy


def for_run(spec: str, *, linear_probe: bool, rung_planner: str, planner: str | None = None,
            probe: str | None = None, eviction: str | None = None) -> Policy:  # fmt: skip
    """The policy a run uses: ``spec`` loaded, what it leaves open filled in by the rung,
    then the command line's single fields on top — they win over the rung's choice too
    (``--rung R1 --probe gallop`` gallops)."""
    policy = for_rung(load_policy(spec), linear_probe=linear_probe, planner=rung_planner)
    return with_overrides(policy, planner=planner, probe=probe, eviction=eviction)
