"""The server's output constraints: ``response_format`` and vLLM's structured-output extras.

Each becomes one ``StructuredOutputsParams`` (nbengine/structured_outputs.py), enforced by
the same grammar path as in Python (docs/structured-outputs.md); docs/serving.md lists
the fields:

- ``response_format`` (chat only): ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}`` is the schema, ``{"type": "json_object"}`` any
  JSON object, ``{"type": "text"}`` no constraint.
- ``structured_outputs`` (both routes): vLLM's dict, with ``StructuredOutputsParams``'
  fields (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
  ``disable_any_whitespace``, ``any_whitespace``).
- ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (both routes):
  vLLM's older spellings.

A request may set one of them. Any error about a constraint is a 400 whose ``param`` is
the field the client sent (``response_format.json_schema.schema``, ``guided_regex``, ...),
whether it is found here (a wrong type, two constraints) or when the grammar is compiled
at ``generate()`` (a bad schema or regex): ``name_field`` renames the engine's message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from nbengine.sampling_params import SamplingParams
from nbengine.server.protocol import ProtocolError
from nbengine.structured_outputs import StructuredOutputsParams

__all__ = ["Constraint", "constrained", "constraint_of", "name_field"]

# The engine's messages about a spec begin with its field: "structured_outputs.json is
# invalid: ...", "structured_outputs must set exactly one of ...".
_ENGINE_FIELD_RE = re.compile(r"^structured_outputs(?:\.[a-z_]+)?")

# The request fields that carry a constraint, in the order conflicts are reported.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _Strict(BaseModel):
    # As the request models (protocol.py): unknown fields are refused, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class _JsonSchema(_Strict):
    """``response_format.json_schema``, as OpenAI defines it."""

    name: StrictStr
    description: StrictStr | None = None
    # "schema" would shadow a BaseModel attribute; the alias is the wire name.
    schema_: dict[str, Any] | StrictBool = Field(alias="schema")
    strict: StrictBool | None = None  # the schema is always enforced


class _ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None


class _StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` dict: the fields ``StructuredOutputsParams`` takes."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    any_whitespace: StrictBool = False


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's constraint: the spec, and the request field it came from (named by
    every error about it)."""

    spec: StructuredOutputsParams
    field: str


def _validated(model: type[_Strict], value: Any, field: str) -> Any:
    """``value`` as ``model``, or a 400 naming the field inside ``field`` at fault."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join((field, *_input_path(value, err)))[:200]
        raise ProtocolError(400, f"{param}: {err['msg']}", param=param) from None


def _input_path(value: Any, err: Any) -> list[str]:
    """The part of a pydantic error's location that names the client's input: the keys
    and indices that exist in ``value`` (and a missing field's name), without the type
    names pydantic adds inside a union (``dict[str,any]``)."""
    path: list[str] = []
    node = value
    for part in err["loc"]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            if err["type"] == "missing":
                path.append(str(part))
            break
        path.append(str(part))
    return path


def _spec(field: str, make: Callable[[], StructuredOutputsParams]) -> Constraint:
    """The constraint ``make`` builds; its ValueError/TypeError a 400 naming ``field``."""
    try:
        return Constraint(make(), field)
    except (ValueError, TypeError) as exc:
        raise _renamed(str(exc), field) from None


def _renamed(message: str, field: str) -> ProtocolError:
    """The engine's ``message`` about a spec, as a 400 about the client's ``field``."""
    if field != "structured_outputs":
        message = _ENGINE_FIELD_RE.sub(field, message, count=1)
    else:  # the client's own field names the part: structured_outputs.json, ...
        m = _ENGINE_FIELD_RE.match(message)
        field = m.group() if m else field
    return ProtocolError(400, message, param=field)


def _from_response_format(value: dict[str, Any]) -> Constraint | None:
    fmt = _validated(_ResponseFormat, value, "response_format")
    if fmt.type != "json_schema" and fmt.json_schema is not None:
        raise ProtocolError(
            400,
            f"response_format.json_schema goes with type 'json_schema', not {fmt.type!r}.",
            param="response_format.json_schema",
        )
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _spec("response_format", lambda: StructuredOutputsParams(json_object=True))
    if fmt.json_schema is None:
        raise ProtocolError(
            400,
            "response_format.json_schema is required with type 'json_schema'.",
            param="response_format.json_schema",
        )
    schema = fmt.json_schema.schema_
    return _spec("response_format.json_schema.schema", lambda: StructuredOutputsParams(json=schema))


def _from_structured_outputs(value: dict[str, Any]) -> Constraint:
    so = _validated(_StructuredOutputs, value, "structured_outputs")
    return _spec(
        "structured_outputs",
        lambda: StructuredOutputsParams(
            json=so.json_,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=so.json_object,
            disable_any_whitespace=so.disable_any_whitespace,
            any_whitespace=so.any_whitespace,
        ),
    )


def _from_guided(name: str, value: Any) -> Constraint:
    kind = name.removeprefix("guided_")
    return _spec(name, lambda: StructuredOutputsParams(**{kind: value}))


def constraint_of(req: Any) -> Constraint | None:
    """The constraint of a parsed request (``protocol.CompletionRequest`` or
    ``ChatCompletionRequest``), None without one; a 400 naming the field for a bad one
    or for two at once."""
    fields = ("response_format", "structured_outputs", *_GUIDED)
    given: list[tuple[str, Any]] = [
        (f, getattr(req, f)) for f in fields if getattr(req, f, None) is not None
    ]
    if len(given) > 1:
        first, second = given[0][0], given[1][0]
        raise ProtocolError(
            400,
            f"{second}: {first} and {second} both constrain the output; send one of them.",
            param=second,
        )
    if not given:
        return None
    name, value = given[0]
    if name == "response_format":
        return _from_response_format(value)
    if name == "structured_outputs":
        return _from_structured_outputs(value)
    return _from_guided(name, value)


def constrained(params: SamplingParams, constraint: Constraint | None) -> SamplingParams:
    """``params`` with ``constraint``'s spec (``params`` itself without one); a 400 if
    ``params`` is constrained already (by another of the request's fields)."""
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ProtocolError(
            400,
            f"{constraint.field}: the request's output is constrained already "
            "(by another of its fields); send one constraint.",
            param=constraint.field,
        )
    return params.replace(structured_outputs=constraint.spec)


def name_field(exc: ProtocolError, constraint: Constraint | None) -> ProtocolError:
    """``exc`` (the engine's refusal at ``generate()``), naming the constraint's field
    when it is about the grammar (a schema or regex that does not compile)."""
    if constraint is None or exc.status != 400 or not _ENGINE_FIELD_RE.match(exc.message):
        return exc
    return _renamed(exc.message, constraint.field)
