"""The house rules that a reader would otherwise have to check by hand (``.ci/house.py``): no import circle in
``engine/`` and ``service/`` (type-only imports included), no class over 25 methods without a written reason,
no record built with five or more positional arguments."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _house():
    spec = importlib.util.spec_from_file_location("house", ROOT / ".ci" / "house.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["house"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_house_rules_hold():
    house = _house()
    assert house.check(house.modules()) == []


def test_the_circle_finder_finds_a_circle():
    house = _house()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert house.circles(graph) == [["a", "b", "c"]]
