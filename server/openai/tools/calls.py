"""`tools` and `tool_choice`: what the model is asked for, the constraint that makes it comply, and the
`tool_calls` made of its output.

    none      tools not shown to the model; plain text
    auto      tools in the chat template; calls parsed from the text (tool_parsers): the first one only when
              parallel_tool_calls is false (as vLLM filters them: the model may still write several)
    required  output constrained to a JSON list of {"name", "arguments"} over the tools' schemas (one call
              when parallel_tool_calls is false; the list may end after any call)
    named     output constrained to the named function's arguments
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from engine.structured import StructuredOutputs
from server.http.errors import bad_request
from server.openai.tools.array_reader import ToolArrayReader
from server.openai.tools.parsers import ParsedCall, parse_tool_calls

ToolMode = Literal["none", "auto", "required", "named"]
_DEFINITIONS = ("$defs", "definitions")  # where a schema keeps the subschemas its references name


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: ToolMode
    functions: dict[str, dict] = field(default_factory=dict)  # name -> the tool's "function" object
    tools: Optional[list[dict]] = None  # for the chat template (None: not shown)
    named: Optional[str] = None
    parallel: bool = True  # parallel_tool_calls not false: every call found; false: the first alone

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def constraint(self, parallel_tool_calls: Optional[bool]) -> Optional[tuple[StructuredOutputs, str]]:
        """The grammar of a valid answer under `required` or a named function (None otherwise)."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputs.of_kind("json", _parameters(self.functions[self.named]), "tools"), "tools"
        if self.mode != "required":
            return None
        # Each function's definitions (`$defs`, `definitions`: what pydantic writes for a nested model) move to the
        # array's root, where their "#/$defs/..." references point once the parameters sit inside it (as vLLM
        # gathers them); a name two functions define differently is a 400.
        definitions: dict[str, dict[str, Any]] = {}
        calls = []
        for i, (name, function) in enumerate(self.functions.items()):
            parameters = dict(_parameters(function))
            for keyword in (k for k in _DEFINITIONS if isinstance(parameters.get(k), dict)):
                for def_name, def_schema in parameters.pop(keyword).items():
                    known = definitions.setdefault(keyword, {})
                    if def_name in known and known[def_name] != def_schema:
                        raise bad_request(
                            f"the definition {def_name!r} differs between two functions' parameters; "
                            "tool_choice 'required' needs one schema per name.",
                            param=f"tools[{i}].function.parameters.{keyword}.{def_name}",
                        )
                    known[def_name] = def_schema
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **definitions}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputs.of_kind("json", schema, "tools"), "tools"

    def finish_reason(self, engine_reason: Optional[str], called: bool) -> Optional[str]:
        """The choice's finish_reason: "tool_calls" when the model stopped after writing calls (`called`), but under
        a named function, which OpenAI (and vLLM) report as "stop"; "length" and the rest as the engine gave them."""
        return "tool_calls" if called and engine_reason == "stop" and self.mode != "named" else engine_reason

    def calls_of(self, text: str, parser: str) -> tuple[Optional[str], list[ParsedCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ParsedCall(self.named, text)]
        if self.mode == "required":  # the arguments as written (what a stream sends), cut short or not
            array = ToolArrayReader()
            array.feed(text)
            calls = [ParsedCall(c.name, array.arguments(c)) for c in array.calls if c.name is not None]
            return (None, calls) if calls else (text, [])
        if self.mode == "auto":
            content, calls = parse_tool_calls(text, parser)
            return content, calls if self.parallel else calls[:1]
        return text, []


def plan_tools(tools: Optional[list[dict]], tool_choice: Any, parallel_tool_calls: Optional[bool] = None) -> ToolPlan:
    """Validate `tools` and `tool_choice` (400s naming them) into a ToolPlan; `parallel_tool_calls` false keeps
    an `auto` output's calls to its first."""
    functions = _functions(tools or [])
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none" or (tool_choice == "auto" and not functions):
        return ToolPlan("none", functions)
    if tool_choice in ("auto", "required"):
        if not functions:
            raise bad_request("tool_choice 'required' needs tools.", param="tool_choice")
        if tool_choice == "required":
            _check_parameters(tools or [], set(functions))
        return ToolPlan(tool_choice, functions, list(tools or []), parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in functions:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools.", param="tool_choice"
            )
        _check_parameters(tools or [], {name})
        return ToolPlan("named", functions, list(tools or []), name, parallel=parallel)
    raise bad_request(
        'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}.',
        param="tool_choice",
    )


def tool_call_dicts(calls: list[ParsedCall]) -> list[dict]:
    """OpenAI's `message.tool_calls`: ids, type function, name, arguments as a JSON string."""
    return [
        {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _functions(tools: list) -> dict[str, dict]:
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type must be 'function' (only function tools are supported).",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request("a function tool needs function.name.", param=f"tools[{i}].function")
        if function["name"] in functions:  # as OpenAI: which of the two a call meant could not be told
            raise bad_request(
                f"tools[{i}] repeats the function name {function['name']!r}.", param=f"tools[{i}].function.name"
            )
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise bad_request(
                "function.parameters must be a JSON Schema object.", param=f"tools[{i}].function.parameters"
            )
        functions[function["name"]] = function
    return functions


def _check_parameters(tools: list[dict], names: set[str]) -> None:
    """The parameter schemas of `names` a constraint is built from: a keyword the grammar cannot enforce is a 400
    naming the tool (under `auto` the schemas are only shown to the model, as vLLM shows them, and not checked)."""
    for i, tool in enumerate(tools):
        if tool["function"]["name"] in names:
            StructuredOutputs.of_kind("json", _parameters(tool["function"]), f"tools[{i}].function.parameters")


def _parameters(function: dict) -> dict:
    """A function's parameter schema; none given is an empty parameter list, as OpenAI reads it."""
    if "parameters" not in function or function["parameters"] is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return function["parameters"] or {"type": "object"}  # `{}`: an object of any properties
