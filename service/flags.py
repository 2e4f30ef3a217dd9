"""Command-line flags with environment twins, derived from the config dataclasses' fields.

Every flag has an environment twin, PAGEDSERVE_<FLAG> (dashes as underscores); the flag
wins when both are given, and a repeatable flag takes a comma-separated list from it. A
config field whose metadata has a ``help`` is a flag: --field-name unless the metadata
names a ``flag`` (on a field that defaults to True, that flag turns it off; a tuple field's
flag is repeatable); its type, default and choices are the field's. It is listed in its
config's section, or in the one its metadata's ``group`` names (``group="model"``: the
options gateway and worker share). Fields of the same name in two configs are one option
(``service.config.shared``); a ``secret=True`` one reaches child processes through the
environment, never in their argv, which any user of the machine can read.
"""
from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Collection, Iterable
from dataclasses import Field, fields
from typing import Any

from engine.field_specs import choices, value_type

_TRUE = {"1", "true", "yes", "on"}
Section = tuple[str, type]  # a section title and the config class whose options it lists


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
    if action == "append":
        kwargs["action"] = _AppendOverDefault
    group.add_argument(flag, help=f"{help}{shown} [env {env}]", **kwargs)


class _AppendOverDefault(argparse._AppendAction):
    """A repeatable flag whose first use replaces its default (argparse's append adds to it): the flag's
    values win over the environment twin's, not join them."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is self.default:  # argparse put the default itself there
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


@functools.cache
def options(cls: type) -> tuple[Field, ...]:
    """The fields of config class ``cls`` that are command-line options."""
    return tuple(f for f in fields(cls) if "help" in f.metadata)


def flag_name(f: Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def add_config_flags(parser: argparse.ArgumentParser, sections: Iterable[Section],
                     without: Collection[str] = ()) -> None:
    """Adds the options of each section's config, but those named in ``without``; each
    flag's dest is its field's name, and a name met again (a shared option) is added once."""
    groups: dict[str, list[tuple[type, Field]]] = {}
    seen = set(without)
    for title, cls in sections:
        for f in options(cls):
            if f.name not in seen:
                seen.add(f.name)
                groups.setdefault(f.metadata.get("group", title), []).append((cls, f))
    for title, members in groups.items():
        group = parser.add_argument_group(title)
        for cls, f in members:
            add_flag(group, flag_name(f), f.metadata["help"], dest=f.name, **_flag_kwargs(cls, f))


def _flag_kwargs(cls: type, f: Field) -> dict[str, Any]:
    kind = value_type(cls, f.name)
    if kind is bool:
        return {"action": "store_false" if f.default else "store_true"}
    if allowed := choices(cls, f.name):
        return {"type": kind, "default": f.default, "choices": [c for c in allowed if c is not None]}  # None: unset
    metavar = flag_name(f).lstrip("-").upper().replace("-", "_")  # the flag's name, not the field's
    if kind is tuple:
        return {"action": "append", "default": list(f.default), "metavar": metavar}
    return {"type": kind, "default": f.default, "metavar": metavar}


def config_from_args(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """A ``cls`` from the parsed flags of its options, ``values`` (e.g. nested configs) overriding them."""
    parsed = {f.name: getattr(args, f.name) for f in options(cls)}
    return cls(**{k: tuple(v) if value_type(cls, k) is tuple else v for k, v in {**parsed, **values}.items()})


def config_argv(config: Any) -> list[str]:
    """The flags that give a child process ``config``'s public options (those at their default are left out)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_flags(parser, [("", type(config))])
    return changed_flags(parser, {f.name: getattr(config, f.name) for f in options(type(config)) if not _secret(f)})


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
            out += [x for v in (value if isinstance(value, (list, tuple)) else [value]) for x in (flag, str(v))]
    return out


def public_values(sections: Iterable[Section], args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags a child's command line may carry: all but the secret options."""
    secret = {f.name for _, cls in sections for f in options(cls) if _secret(f)}
    return {k: v for k, v in vars(args).items() if k not in secret}


def secret_env(sections: Iterable[Section], args: argparse.Namespace) -> dict[str, str]:
    """The secret options' parsed values, as the environment twins a child process reads."""
    return {env_name(flag_name(f)): ",".join(value) if isinstance(value, list) else str(value)
            for _, cls in sections for f in options(cls)
            if _secret(f) and (value := getattr(args, f.name, None)) is not None and value != []}


def _secret(f: Field) -> bool:
    return f.metadata.get("secret", False)
