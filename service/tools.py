"""``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request, validated, and the grammar that
forces a call when ``tool_choice`` is "required" or names a function."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output import StructuredOutputParams

from service.errors import APIError

MAX_TOOLS = 128  # OpenAI's cap
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's function names
_CHOICES = ("none", "auto", "required")
_ANY_OBJECT = {"type": "object", "properties": {}}
_KIND_NAMES = {dict: "JSON schema object", str: "string", bool: "boolean"}


@dataclass(slots=True)
class ToolRequest:
    """``tools`` as function dicts {name, description?, parameters}; ``choice`` is "none", "auto",
    "required" or "function" (then ``name`` is the forced function's)."""

    tools: list[dict[str, Any]]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True
    _by_name: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {t["name"]: t for t in self.tools}

    @property
    def forced(self) -> bool:
        """The grammar makes the model call a tool: its output is the call's JSON, not free text."""
        return self.choice in ("required", "function")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema of a forced call's output: the named function's arguments, or for "required" a
        list of {"name", "parameters"} (one item when parallel_tool_calls is false)."""
        if self.choice == "function":
            return _parameters(self._by_name[self.name])
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["name"]}, "parameters": _parameters(t)},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return schema | ({} if self.parallel else {"maxItems": 1})

    def structured_output(self) -> StructuredOutputParams | None:
        """The forced call's grammar as ``StructuredOutputParams`` (None for "auto" / "none")."""
        schema = self.schema()
        return None if schema is None else StructuredOutputParams(json=json.dumps(schema))

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template's ``tools=`` gets: OpenAI's tool objects (none when tool_choice is "none")."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": t} for t in self.tools]


def parse_tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The body's tools, tool_choice and parallel_tool_calls; None without tools (a tool_choice of "none" or
    "auto" then has nothing to choose from: it changes nothing; one that forces a call is a 400)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if _parse_choice(choice, set())[0] == "required":  # a named function is not among no tools either
            raise _bad("tool_choice 'required' needs tools", param="tool_choice")
        return None
    functions = _parse_tools(tools)
    kind, name = _parse_choice(choice, {f["name"] for f in functions})
    return ToolRequest(functions, kind, name, parallel)


def _parse_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("tools must be a list", param="tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools are accepted, got {len(tools)}", param="tools")
    functions = [_parse_tool(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise _bad("tool names must be unique", param="tools")
    return functions


def _parse_tool(i: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param=param)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _bad(f"{param}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -",
                       param=param)
    for key, kind in (("parameters", dict), ("description", str), ("strict", bool)):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise _bad(f"{param}.function.{key} must be a {_KIND_NAMES[kind]}", param=param)
    return fn  # as sent: the chat template renders the client's own function dict


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or _ANY_OBJECT


def _parse_choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str) and choice in _CHOICES:
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise _bad(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "function", name


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def check_tool_parser(tools: ToolRequest | None, parser: str | None) -> None:
    """tool_choice "auto" needs a parser to find the calls in the model's free text."""
    if tools is not None and tools.choice == "auto" and parser in (None, "none"):
        raise _bad("tool_choice 'auto' needs a tool-call parser: this server was started with "
                            "--tool-call-parser none (use 'required', a named function, or restart the gateway "
                            "with e.g. --tool-call-parser hermes)", param="tool_choice")
