"""The output constraint an HTTP request asks for, whichever of its spellings it used: OpenAI's
`response_format`, vLLM's `guided_json|regex|choice|grammar` extras, or vLLM's newer `structured_outputs`
object. One per request; a malformed one is a 400 naming the field it came in here, and one that cannot
compile is, at admission (AsyncLLM.admit checks it, given the field).
"""
from __future__ import annotations

from aserve.errors import InvalidRequestError
from aserve.server import protocol as p
from aserve.structured_output import StructuredOutputsParams

GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
          ("guided_grammar", "grammar"))


def _asked(req: p.SamplingFields) -> list[tuple[str, dict]]:
    """(field, StructuredOutputsParams keyword arguments) for every constraint the request gives."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                      "response_format")
        found.append(("response_format", {"json": fmt.json_schema.schema}))
    for name, kind in GUIDED:
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    so = req.structured_outputs
    if so is not None:
        given = {k: getattr(so, k) for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(so, k) not in (None, False)}
        found.append(("structured_outputs", {**given, "any_whitespace": so.any_whitespace}))
    return found


def build(req: p.SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came in; InvalidRequestError for two, or a malformed one."""
    found = _asked(req)
    if not found:
        return None, None
    if len(found) > 1:
        raise InvalidRequestError(f"give one output constraint, not both {found[0][0]} and {found[1][0]}",
                                  found[1][0])
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{field}: {exc}", field) from None
