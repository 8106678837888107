"""Structured outputs and tools: from `response_format`, `tools` and `tool_choice` to a
grammar, from the model's text back to OpenAI's `tool_calls`.

The output format of tool calls is Hermes' (which Qwen's and many other chat
templates teach their models), one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Blocks are separated by one newline. The grammar (llguidance Lark, the call's JSON held
to a `oneOf` of the tools' schemas with `name` first and `arguments` last, and JSON laid
out with no freedom: `", "` and `": "`) makes this layout exact, so `ToolCallParser`
needs no guessing: it reads the name as soon as its closing quote arrives and streams
the arguments' text as it is generated. With `tool_choice: "auto"` the model writes
either text (not starting with `<`) or calls; `"required"` or a named function allow
calls only; `"none"` leaves the output unconstrained and unparsed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from yb_gateway.errors import invalid_request
from yb_gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionCallDelta,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
    ToolDefinition,
)
from yb_text.grammar import GrammarError, json_schema_grammar, lark_grammar

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
_NAME_OPEN = '{"name": '
_ARGS_OPEN = ', "arguments": '

#: How generated JSON is laid out (llguidance's JSON options): what `ToolCallParser`
#: reads, and what keeps a small model from stalling in a run of blanks.
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

ToolMode = Literal["none", "auto", "required"]


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """What a request's output is held to: `grammar` ("" for none), and whether its text
    is parsed into tool calls (`tools`: "none", "auto" text or calls, "required")."""

    grammar: str = ""
    tools: ToolMode = "none"
    #: The parameter a grammar error is reported against.
    param: str | None = None


def output_spec(body: ChatCompletionRequest) -> OutputSpec:
    """The grammar of a chat request's `response_format`, `tools` and `tool_choice`.

    Raises `ApiError` (400) for a `tool_choice` naming no tool, or a schema llguidance
    cannot compile (without the tokenizer: `prompt.PromptEncoder.check_grammar` does the
    rest).
    """
    text_json = _response_schema(body)
    tools = body.tools or []
    tools_by_name(tools)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools and choice != "none":
        raise invalid_request(
            "`tool_choice` asks for a tool call, but `tools` lists none.", param="tool_choice"
        )
    if choice == "none" or not tools:
        if text_json is None:
            return OutputSpec()
        grammar = _compile(lambda: json_schema_grammar(text_json), "response_format")
        return OutputSpec(grammar=grammar, param="response_format")
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise invalid_request(
                f"`tool_choice` names the function `{choice.function.name}`, "
                "which `tools` does not define.",
                param="tool_choice.function.name",
            )
        mode: ToolMode = "required"
        tools, many = named, False
    else:
        mode = choice
        many = body.parallel_tool_calls is not False
    text = None if mode == "required" else (text_json or {})
    lark = tool_call_lark(tools, text=text, many=many)
    grammar = _compile(lambda: lark_grammar(lark), "tools")
    return OutputSpec(grammar=grammar, tools=mode, param="tools")


def _response_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema that text output must follow, None for free text."""
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "object"}
    if isinstance(fmt, JsonSchemaFormat):
        return fmt.json_schema.schema or {"type": "object"}
    return None


def _compile(build: Callable[[], str], param: str) -> str:
    try:
        grammar = build()
    except GrammarError as exc:
        raise invalid_request(f"Invalid schema: {exc}", param=param) from exc
    return grammar


def _call_schema(tool: ToolDefinition) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object"}
    return {
        "type": "object",
        # `name` first, `arguments` last: the order `ToolCallParser` reads them in.
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_lark(tools: list[ToolDefinition], *, text: dict[str, Any] | None, many: bool) -> str:
    """Lark text for tool-call blocks of `tools` (one, or `many` separated by a newline);
    with `text` a JSON schema or {} for free text, the output may be text instead
    (free text must not start with `<`, so the two cannot be confused)."""
    calls = {"oneOf": [_call_schema(t) for t in tools], "x-guidance": JSON_LAYOUT}
    rules = [
        'call: "<tool_call>\\n" call_json "\\n</tool_call>"',
        f"call_json: %json {json.dumps(calls)}",
        'calls: call ("\\n" call)*' if many else "calls: call",
    ]
    if text is None:
        rules.insert(0, "start: calls")
    else:
        rules.insert(0, "start: calls | text")
        if text:
            rules.append(f"text: %json {json.dumps({**text, 'x-guidance': JSON_LAYOUT})}")
        else:
            rules.append("text: TEXT")
            rules.append("TEXT: /[^<](.|\\n)*/")
    return "\n".join(rules) + "\n"


# --- the prompt -----------------------------------------------------------------------


def template_uses_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders the `tools` it is given (SmolLM2's does not)."""
    return bool(chat_template) and "tools" in str(chat_template)


def tools_system_text(tools: list[ToolDefinition]) -> str:
    """The system text that presents `tools` to a model whose template ignores them,
    and the output format the grammar will hold it to."""
    listed = "\n".join(json.dumps(tool) for tool in template_tools_arg(tools))
    return (
        "You may call functions to answer. The functions, as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, write only this, for each call:\n"
        f'{CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CALL_CLOSE}'
    )


def render_call(name: str, arguments: Any) -> str:
    """One tool-call block, as the grammar has the model write it."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(", ", ": "))
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def history_arguments(message: ChatMessage, index: int) -> list[tuple[str, str, Any]]:
    """(id, name, parsed arguments) of an assistant message's tool calls; 400 when the
    arguments are not a JSON object."""
    calls = []
    for j, call in enumerate(message.tool_calls or []):
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError as exc:
            raise invalid_request(
                f"The tool call's arguments are not JSON: {exc}",
                param=f"messages[{index}].tool_calls[{j}].function.arguments",
            ) from exc
        calls.append((call.id, call.function.name, arguments))
    return calls


def conversation(
    messages: list[ChatMessage],
    tools: list[ToolDefinition],
    *,
    template_tools: bool,
    text_of: Any,
) -> list[dict[str, Any]]:
    """The messages as a chat template takes them (`text_of(index, message)` gives a
    message's text). A template that renders tools gets tool calls and results in the
    Hugging Face form; for one that does not, they are written into the text in the
    format the model is asked to write, and the tools go into the system message."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        text = text_of(i, message)
        entry: dict[str, Any] = {"role": message.role, "content": text}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id is not None and message.role != "tool":
            raise invalid_request(
                "Only messages of role `tool` carry `tool_call_id` (the call they answer).",
                param=f"messages[{i}].tool_call_id",
            )
        if message.role == "tool":
            if not message.tool_call_id:
                raise invalid_request(
                    "A message of role `tool` needs the `tool_call_id` it answers.",
                    param=f"messages[{i}].tool_call_id",
                )
            if template_tools:
                entry["tool_call_id"] = message.tool_call_id
            else:
                entry["content"] = f"<tool_response>\n{text}\n</tool_response>"
        if message.tool_calls:
            if message.role != "assistant":
                raise invalid_request(
                    "Only assistant messages carry `tool_calls`.",
                    param=f"messages[{i}].tool_calls",
                )
            calls = history_arguments(message, i)
            if template_tools:
                entry["tool_calls"] = [
                    {"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                    for cid, n, a in calls
                ]
            else:
                blocks = "\n".join(render_call(n, a) for _, n, a in calls)
                entry["content"] = f"{text}\n{blocks}" if text else blocks
        out.append(entry)
    if tools and not template_tools:
        system = tools_system_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{system}"
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def template_tools_arg(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """`tools` as `apply_chat_template` takes them (OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.function.name,
                "description": t.function.description or "",
                "parameters": t.function.parameters or {"type": "object"},
            },
        }
        for t in tools
    ]


# --- the output -----------------------------------------------------------------------


def new_call_id() -> str:
    """A tool call id in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class _Call:
    id: str
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of generated text added: plain content, and tool-call deltas."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    """Reads one choice's text, as it is generated, into content and tool calls.

    Text is fed in pieces (`feed`); each returns the content and the tool-call deltas it
    completes: a call's first delta (index, id, type, name, `arguments: ""`) as soon as
    its name is read, then the arguments' text as it comes. With mode "auto", text that
    does not start a call block is content. Built on the exact layout the grammar
    enforces; text that breaks it (a cut-off generation) ends the parse, and what
    follows is content.
    """

    def __init__(self, mode: ToolMode) -> None:
        self._mode = mode
        self._state = "undecided" if mode == "auto" else ("open" if mode != "none" else "text")
        self._pending = ""  # text read but not yet consumed by the state machine
        self.calls: list[_Call] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> ParsedDelta:
        """The content and tool-call deltas `text` completes."""
        out = ParsedDelta()
        self._pending += text
        while self._pending:
            before = (self._state, len(self._pending))
            self._step(out)
            if (self._state, len(self._pending)) == before:
                break  # waiting for more text
        return out

    def _step(self, out: ParsedDelta) -> None:
        pending = self._pending
        match self._state:
            case "text":
                out.content += pending
                self._pending = ""
            case "undecided":
                if pending.startswith(CALL_OPEN):
                    self._state = "open"
                elif not CALL_OPEN.startswith(pending):
                    self._state = "text"
            case "open" | "between":
                lead = CALL_OPEN if self._state == "open" else "\n" + CALL_OPEN
                if pending.startswith(lead + _NAME_OPEN):
                    self._pending = pending[len(lead + _NAME_OPEN) :]
                    self.calls.append(_Call(new_call_id()))
                    self._state = "name"
                elif not (lead + _NAME_OPEN).startswith(pending):
                    self._state = "text"  # not the grammar's layout: the rest is text
            case "name":
                end = _string_end(pending)
                if end is not None:
                    call = self.calls[-1]
                    call.name = json.loads(pending[:end])
                    self._pending = pending[end:]
                    self._state = "args_open"
                    out.tool_calls.append(
                        ToolCallDelta(
                            index=len(self.calls) - 1,
                            id=call.id,
                            type="function",
                            function=FunctionCallDelta(name=call.name, arguments=""),
                        )
                    )
            case "args_open":
                if pending.startswith(_ARGS_OPEN):
                    self._pending = pending[len(_ARGS_OPEN) :]
                    self._state = "args"
                elif not _ARGS_OPEN.startswith(pending):
                    self._state = "text"
            case "args":
                taken = self._take_arguments(pending)
                if taken:
                    self.calls[-1].arguments.append(taken)
                    out.tool_calls.append(
                        ToolCallDelta(
                            index=len(self.calls) - 1, function=FunctionCallDelta(arguments=taken)
                        )
                    )
                self._pending = pending[len(taken) :]
                if self._depth == 0 and taken:
                    self._state = "close"
            case "close":
                tail = "}" + CALL_CLOSE
                if pending.startswith(tail):
                    self._pending = pending[len(tail) :]
                    self._state = "between"
                elif not tail.startswith(pending):
                    self._state = "text"

    def _take_arguments(self, text: str) -> str:
        """The prefix of `text` that belongs to the arguments' JSON value (all of it,
        unless the value ends inside)."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return text[: i + 1]
        return text

    def tool_calls(self) -> list[ToolCall]:
        """The calls read so far, whole."""
        return [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments="".join(c.arguments)))
            for c in self.calls
        ]


def _string_end(text: str) -> int | None:
    """The index just past the JSON string `text` starts with, None if it is not whole."""
    escaped = False
    for i, ch in enumerate(text[1:], start=1):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return i + 1
    return None


def finish_reason(engine_reason: str, parser: ToolCallParser | None) -> str:
    """OpenAI's `tool_calls` when a choice stopped after calling tools."""
    if parser is not None and parser.calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def tools_by_name(tools: list[ToolDefinition]) -> Mapping[str, ToolDefinition]:
    """`tools` by function name; 400 on a name defined twice."""
    seen: dict[str, ToolDefinition] = {}
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise invalid_request(
                f"The function `{tool.function.name}` is defined twice.",
                param=f"tools[{i}].function.name",
            )
        seen[tool.function.name] = tool
    return seen
