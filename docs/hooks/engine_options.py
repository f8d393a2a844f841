"""mkdocs hook: the option tables are built from the code at build time, so the docs cannot drift from it.

`<!-- table: engine-options -->` becomes one row per `aserve.config.EngineConfig` field: its keyword for `LLM` and
`AsyncLLM`, the flag the CLI generates from it (named by the CLI's own `_flag`, typed by its own `_flag_spec`), the
default and the help text in the field's metadata. `<!-- table: server-options -->` becomes the flags `aserve serve`
adds beside the engine's (aserve.server.launch.add_arguments). A marker the hook does not know fails the build.
"""
from __future__ import annotations

import argparse
import re
import typing
from dataclasses import MISSING, fields

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"<!--\s*table:\s*([a-z-]+)\s*-->")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value) -> str:
    return f"`{value}`"


def _kind(spec: dict, kinds: set[type]) -> str:
    """What the flag takes, read from the argparse spec the CLI itself builds for the field (and, where argparse
    passes text on for EngineConfig to parse, from the field's types)."""
    if "choices" in spec:
        return " \\| ".join(_code(choice) for choice in spec["choices"])
    if spec.get("action") is argparse.BooleanOptionalAction:
        return "on / off"
    if spec.get("action") == "append":
        return "`KEY=VALUE`, repeatable"
    kind = spec.get("type")
    if kind is int:
        return "integer"
    if kind is float:
        return "number"
    if kind is not None or (str in kinds and kinds & {int, float}):  # config._number_or_size, or parse_memory
        return "number or size"
    return "text"


def _flags(flag: str, spec: dict) -> str:
    if spec.get("action") is argparse.BooleanOptionalAction:
        return f"{_code(flag)}<br>{_code('--no-' + flag[2:])}"
    return _code(flag)


def _default(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else _code(value)


def engine_options_table() -> str:
    from aserve.config import EngineConfig, _flag, _flag_spec, _kinds

    hints = typing.get_type_hints(EngineConfig)
    rows = ["| option and flag | takes | default | what it does |", "| --- | --- | --- | --- |"]
    for f in fields(EngineConfig):
        spec = _flag_spec(f, hints[f.name])
        default = None if f.default is MISSING else f.default
        rows.append(f"| {_code(f.name)}<br>{_flags(_flag(f), spec)} | {_kind(spec, _kinds(hints[f.name]))} | "
                    f"{_default(default)} | "
                    f"{_cell(spec['help'])} |")
    return "\n".join(rows)


def server_options_table() -> str:
    from aserve.config import EngineConfig
    from aserve.server import launch

    parser = argparse.ArgumentParser(add_help=False)
    launch.add_arguments(parser)
    engine = {f.name for f in fields(EngineConfig)}
    rows = ["| flag | takes | default | what it does |", "| --- | --- | --- | --- |"]
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        if action.dest in engine or not action.option_strings:
            continue
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            takes, default, what = "switch", "not given", action.help
        else:
            takes = {int: "integer", float: "number"}.get(action.type, "text")
            if action.nargs == "*":
                takes = "zero or more values"
            default = "none" if action.default in (None, "", []) else _code(action.default)
            what = action.help or UNDOCUMENTED.get(flag, "")
        if flag == "--api-key":
            default = "`$ASERVE_API_KEY`, else none"  # read from the environment when the parser is built
        rows.append(f"| {_code(flag)} | {takes} | {default} | {_cell(what)} |")
    return "\n".join(rows)


# The few server flags that carry no help text of their own.
UNDOCUMENTED = {"--host": "the address to listen on", "--port": "the port to listen on"}

TABLES = {"engine-options": engine_options_table, "server-options": server_options_table}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise PluginError(f"{page.file.src_uri}: unknown table marker <!-- table: {name} -->; "
                              f"known: {', '.join(TABLES)}")
        return TABLES[name]()

    return MARKER.sub(replace, markdown)
