"""The server's engine protocol: the real engine and the tests' stand-in both keep it."""

from __future__ import annotations

import inspect

import pytest

from tests.helpers.fake_engine import FakeEngine
from wavepp.engine import Engine
from wavepp.serve.protocol import ServedEngine


def _members(protocol: type) -> dict[str, object]:
    """Name -> the protocol's member: a function, a property, or None for a data attribute."""
    out: dict[str, object] = dict.fromkeys(protocol.__annotations__)
    out.update({name: value for name, value in vars(protocol).items()
                if not name.startswith("_") and (callable(value) or isinstance(value, property))})
    return out


def _signature_problems(name: str, wanted, found) -> list[str]:
    if inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(found):
        return [f"{name}: async in one and not the other"]
    empty = inspect.Parameter.empty
    have, asked = inspect.signature(found).parameters, inspect.signature(wanted).parameters
    problems = []
    for param in asked.values():
        other = have.get(param.name)
        if other is None or other.kind != param.kind:
            problems.append(f"{name}: no parameter {param}")
        elif (param.default is empty) != (other.default is empty):
            problems.append(f"{name}: {param.name} has a default in one only")
    extra = [p for n, p in have.items() if n not in asked and p.default is empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # fmt: skip
    problems += [f"{name}: {p.name} is required but the server never passes it" for p in extra]
    return problems


def problems(cls: type) -> list[str]:
    """How ``cls`` breaks ``ServedEngine``: missing members, or methods the server cannot
    call the way it does. A data attribute must be set by the constructor."""
    out = []
    for name, wanted in _members(ServedEngine).items():
        found = inspect.getattr_static(cls, name, None)
        if wanted is None or isinstance(wanted, property):
            if found is None and name not in cls.__init__.__code__.co_names:
                out.append(f"{name}: neither a property nor set by __init__")
        elif not inspect.isfunction(found):
            out.append(f"{name}: not a method")
        else:
            out += _signature_problems(name, wanted, found)
    return out


@pytest.mark.parametrize("cls", [Engine, FakeEngine])
def test_the_engine_and_the_stand_in_keep_the_servers_protocol(cls):
    assert problems(cls) == []


def test_the_stand_in_is_an_instance_of_the_protocol():
    assert isinstance(FakeEngine(), ServedEngine)


def test_the_check_finds_what_an_engine_lacks():
    class Partial(FakeEngine):
        fault = None  # not a method

        async def submit(self, tokens, *, request_id, priority=0):  # request_id required
            raise NotImplementedError

    found = problems(Partial)
    assert "fault: not a method" in found
    assert any(p.startswith("submit: request_id has a default") for p in found)
    assert any(p.startswith("submit: no parameter handoff") for p in found)
