"""Command-line flags with environment twins; the engine's flags come from EngineConfig.

Every flag has an environment twin, PAGEDSERVE_<FLAG> (dashes as underscores);
the flag wins when both are given. An EngineConfig field whose metadata has a
``help`` is a flag: --field-name unless the metadata names a ``flag`` (on a
field that defaults to True, that flag turns it off); its type, default and
choices are the field's; ``group="model"`` puts it with the options the gateway
shares (--model, --max-model-len), the rest are the worker's "engine" options.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import Field, fields
from typing import Any

from engine.config import EngineConfig
from engine.field_specs import choices, value_type

_TRUE = {"1", "true", "yes", "on"}
_ENGINE_OPTIONS = [f for f in fields(EngineConfig) if "help" in f.metadata]


def env_name(flag: str) -> str:
    return "PAGEDSERVE_" + flag.lstrip("-").upper().replace("-", "_")


def add_flag(group: Any, flag: str, help: str, **kwargs: Any) -> None:
    """Adds a flag whose default comes from its environment twin."""
    env = env_name(flag)
    raw = os.environ.get(env)
    action = kwargs.get("action")
    if raw is not None:
        if action in ("store_true", "store_false"):
            kwargs["default"] = (raw.strip().lower() in _TRUE) == (action == "store_true")
        elif action == "append":
            kwargs["default"] = [v for v in raw.split(",") if v]
        else:
            kwargs["default"] = kwargs.get("type", str)(raw)
    shown = "" if action in ("store_true", "store_false", "append") or kwargs.get("default") is None \
        else " (default: %(default)s)"
    group.add_argument(flag, help=f"{help}{shown} [env {env}]", **kwargs)


def add_engine_flags(group: Any, section: str) -> None:
    """The EngineConfig options of one section: "model" or "engine"."""
    for f in _ENGINE_OPTIONS:
        if f.metadata.get("group", "engine") == section:
            add_flag(group, f.metadata.get("flag", "--" + f.name.replace("_", "-")), f.metadata["help"],
                     dest=f.name, **_flag_kwargs(f))


def _flag_kwargs(f: Field) -> dict[str, Any]:
    kind = value_type(EngineConfig, f.name)
    if kind is bool:
        return {"action": "store_false" if f.default else "store_true"}
    allowed = choices(EngineConfig, f.name)
    return {"type": kind, "default": f.default, **({"choices": list(allowed)} if allowed else {})}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the parsed flags set."""
    return {f.name: getattr(args, f.name) for f in _ENGINE_OPTIONS}


def engine_argv(config: EngineConfig) -> list[str]:
    """The flags that give a worker ``config``'s options (those at their default are left out)."""
    parser = argparse.ArgumentParser(add_help=False)
    for section in ("model", "engine"):
        add_engine_flags(parser, section)
    return changed_flags(parser, {f.name: getattr(config, f.name) for f in _ENGINE_OPTIONS})


def changed_flags(parser: argparse.ArgumentParser, values: dict[str, Any]) -> list[str]:
    """The argv that sets ``parser``'s flags to ``values`` where they differ from the defaults."""
    out: list[str] = []
    for action in parser._actions:
        value = values.get(action.dest)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            out.append(flag)
        else:
            out += [x for v in (value if isinstance(value, list) else [value]) for x in (flag, str(v))]
    return out
