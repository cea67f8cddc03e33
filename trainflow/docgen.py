"""The configuration and CLI reference pages, rendered from the code they describe.

``docs/reference/configuration.md`` comes from ``param_schema()``, the function that also
builds the DAG's ``Param``s, so the reference and the trigger form cannot disagree;
``docs/reference/cli.md`` comes from ``trainflow.cli.build_parser()``, the parser the
command itself uses. A test compares the checked-in pages with a fresh rendering, so a
field or an option added without regenerating fails the suite.

    python -m trainflow.docgen           write both pages
    python -m trainflow.docgen --check   exit 1, naming the stale pages, if they differ
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Sequence

CONFIGURATION = Path("docs/reference/configuration.md")
CLI = Path("docs/reference/cli.md")
COMMAND = "python -m trainflow.docgen"
# Fields in no section: the trigger form shows them above its sections, and so does the page.
TOP_SECTION = "General"
_ROOT = Path(__file__).resolve().parents[1]


def _cell(text: str) -> str:
    """``text`` safe in one table cell: one line, no column break, no stray HTML tag
    (``<chip>`` in a description would otherwise vanish from the rendered page)."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def _code(text: Any) -> str:
    """``text`` as code in a table cell. GitHub splits cells on a '|' even inside backticks,
    while MkDocs would then show the backslash of a ``\\|``; an HTML ``<code>`` with the
    characters that either would read as markup written as entities renders the same in both."""
    text = str(text)
    if "|" not in text:
        return f"`{text}`"
    return "<code>" + "".join(f"&#{ord(c)};" if c in "|*_\\`[]<>&" else c for c in text) + "</code>"


def _num(value: Any) -> str:
    return json.dumps(value)


def _bounds(schema: Mapping[str, Any]) -> list[str]:
    """``minimum``/``maximum`` (and the exclusive ones) as ``1..64``, ``≥ 1``, ``> 0, ≤ 10``."""
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and high is not None:
        return [f"{_num(low)}..{_num(high)}"]
    out = []
    if low is not None:
        out.append(f"≥ {_num(low)}")
    if schema.get("exclusiveMinimum") is not None:
        out.append(f"> {_num(schema['exclusiveMinimum'])}")
    if high is not None:
        out.append(f"≤ {_num(high)}")
    if schema.get("exclusiveMaximum") is not None:
        out.append(f"< {_num(schema['exclusiveMaximum'])}")
    return out


def _item(schema: Mapping[str, Any]) -> str:
    """One array item's schema in words: ``string ≤ 4096 characters``, ``integer 1..255``,
    ``{kind, step[, rank, seconds]}; kind: a, b; step ≥ 1``."""
    if schema.get("type") == "object" and "properties" in schema:
        props = schema["properties"]
        required = [k for k in props if k in schema.get("required", ())]
        optional = [k for k in props if k not in required]
        shape = "{" + ", ".join(required) + (f"[, {', '.join(optional)}]" if optional else "") + "}"
        parts = [shape] + [f"{k}: {rule}" for k, sub in props.items() if (rule := _rules(sub))]
        return "; ".join(parts)
    rule = _rules(schema)
    return " ".join(filter(None, [schema.get("type", ""), rule]))


def _rules(schema: Mapping[str, Any]) -> str:
    """What a JSON schema allows, in the words a reader checks a value against."""
    parts: list[str] = []
    if "enum" in schema:
        parts.append(", ".join(str(v) for v in schema["enum"]))
    parts += _bounds(schema)
    if "pattern" in schema:
        parts.append(f"matches {_code(schema['pattern'])}")
    if "maxLength" in schema:
        parts.append(f"≤ {schema['maxLength']} characters")
    if "maxItems" in schema:
        parts.append(f"≤ {schema['maxItems']} items")
    if "maxProperties" in schema:
        parts.append(f"≤ {schema['maxProperties']} entries")
    if "items" in schema:
        parts.append(f"each {_item(schema['items'])}")
    return "; ".join(parts)


def _type(json_type: str | list[str]) -> str:
    names = [json_type] if isinstance(json_type, str) else json_type
    return " or ".join(t for t in names if t != "null")


def _grouped(names: Sequence[str], sections: Mapping[str, Sequence[str]]) -> list[tuple[str, list[str]]]:
    """The spec's fields by form section, in the form's order, each exactly once.

    Raises:
        ValueError: a section names a field the spec does not have, or a field is named twice.
    """
    known, seen = set(names), set()
    for section, members in sections.items():
        for name in members:
            if name not in known:
                raise ValueError(f"SECTIONS[{section!r}] names {name!r}, which is not a TrainingSpec field")
            if name in seen:
                raise ValueError(f"field {name!r} is in more than one of SECTIONS")
            seen.add(name)
    top = [n for n in names if n not in seen]
    groups = ([(TOP_SECTION, top)] if top else []) + [(s, list(m)) for s, m in sections.items()]
    placed = [n for _, members in groups for n in members]
    assert sorted(placed) == sorted(names), "every field on the page exactly once"
    return groups


def render_configuration() -> str:
    """``docs/reference/configuration.md``: one table per trigger-form section."""
    from trainflow.spec import SECTIONS, TrainingSpec, param_schema

    schema = param_schema()
    defaults = TrainingSpec().to_dict()
    names = [f.name for f in fields(TrainingSpec)]
    lines = [
        f"<!-- Generated by `{COMMAND}` from trainflow/spec.py: edit the code, not this page. -->",
        "",
        "# Configuration reference",
        "",
        "These are the fields of a run's conf: the trigger form, the REST `conf` and "
        "`trainflow submit` all take them, and `TrainingSpec` validates them before anything is "
        "allocated. A field left out takes its default (a DAG may set its own defaults). Rules "
        "that join fields, such as `checkpoint_interval` ≤ `steps`, are checked too: "
        "`trainflow validate SPEC.json` reports the field, the value and the fix.",
        "",
    ]
    for section, members in _grouped(names, SECTIONS):
        lines += [f"## {section}", ""]
        if section == TOP_SECTION:
            lines += ["Shown above the trigger form's sections.", ""]
        lines += ["| field | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for name in members:
            param = schema[name]
            keywords = {
                k: v
                for k, v in param.items()
                if k not in ("default", "type", "title", "description", "section", "examples")
            }
            allowed = _rules(keywords) or ("true, false" if param["type"] == "boolean" else "")
            if param.get("examples"):
                allowed += "; e.g. " + ", ".join(map(_code, param["examples"]))
            default = _code(json.dumps(defaults[name], ensure_ascii=False))
            meaning = f"**{_cell(param['title'])}**: {_cell(param['description'])}"
            lines.append(f"| `{name}` | {_type(param['type'])} | {default} | {allowed} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return _code(action.metavar or action.dest)
    if action.nargs == 0:
        return ", ".join(map(_code, action.option_strings))
    metavar = action.metavar or action.dest.upper()
    return ", ".join(_code(f"{flag} {metavar}") for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return _code(action.default)


def _exclusive(parser: argparse.ArgumentParser) -> dict[argparse.Action, str]:
    """The note each member of a mutually exclusive group gets: which options it excludes,
    or, in a required group, that exactly one of them must be given."""
    notes = {}
    for group in parser._mutually_exclusive_groups:
        flags = [a.option_strings[0] for a in group._group_actions if a.option_strings]
        for action in group._group_actions:
            others = [f for f in flags if f not in action.option_strings]
            notes[action] = f"exactly one of {', '.join(flags)}" if group.required else f"not with {', '.join(others)}"
    return notes


def _help(action: argparse.Action, exclusive: Mapping[argparse.Action, str]) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "default": action.default}
    words = set(text.replace("(", " ").replace(")", " ").replace(";", " ").split())
    notes = []
    if action.required and action.option_strings:
        notes.append("required")
    if action.nargs == "?" and not action.option_strings and "optional" not in words:
        notes.append("optional")
    if isinstance(action, argparse._AppendAction) and "repeatable" not in words:
        notes.append("repeatable")
    if action.choices:
        notes.append("one of " + ", ".join(map(str, action.choices)))
    if action in exclusive:
        notes.append(exclusive[action])
    return _cell(" ".join(filter(None, [text, f"({'; '.join(notes)})" if notes else ""])))


def _usage(parser: argparse.ArgumentParser) -> str:
    # A fixed, wide formatter: the terminal's width must not change the page.
    formatter = argparse.HelpFormatter(parser.prog, width=10_000)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, help, parser)`` of every subcommand, in the order the CLI declares them."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    return [(name, helps.get(name, ""), p) for name, p in sub.choices.items()]


def render_cli() -> str:
    """``docs/reference/cli.md``: every subcommand's usage, purpose and arguments."""
    from trainflow import cli

    parser = cli.build_parser()
    commands = _subcommands(parser)
    lines = [
        f"<!-- Generated by `{COMMAND}` from trainflow/cli.py: edit the code, not this page. -->",
        "",
        "# `trainflow` command line",
        "",
        "```",
        _usage(parser),
        "```",
        "",
        *[_cell(p) + "\n" for p in cli.__doc__.split("\n\n") if p.startswith("Exit codes")],
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`{name}`](#trainflow-{name}) | {_cell(text)} |" for name, text, _ in commands]
    lines.append("")
    for name, text, sub in commands:
        exclusive = _exclusive(sub)
        actions = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        lines += [f"## trainflow {name}", "", "```", _usage(sub), "```", "", _cell(text), ""]
        if actions:
            lines += ["| argument | default | help |", "|---|---|---|"]
            lines += [f"| {_flags(a)} | {_default(a)} | {_help(a, exclusive)} |" for a in actions]
            lines.append("")
    return "\n".join(lines)


def pages() -> dict[Path, str]:
    """Each reference page's path (relative to the checkout) and its text."""
    return {CONFIGURATION: render_configuration(), CLI: render_cli()}


def stale(root: Path = _ROOT) -> list[Path]:
    """The pages under ``root`` that differ from a fresh rendering (missing ones included)."""
    out = []
    for rel, text in pages().items():
        path = root / rel
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            out.append(rel)
    return out


def write(root: Path = _ROOT) -> list[Path]:
    """Write every page under ``root``; returns the paths written."""
    written = []
    for rel, text in pages().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="render the configuration and CLI reference")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a checked-in page differs from a fresh rendering"
    )
    parser.add_argument("--root", type=Path, default=_ROOT, help="the checkout (default: this one)")
    args = parser.parse_args(argv)
    if args.check:
        old = stale(args.root)
        if old:
            print(f"stale: {', '.join(map(str, old))}; run `{COMMAND}` and commit the result", file=sys.stderr)
            return 1
        return 0
    for path in write(args.root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
