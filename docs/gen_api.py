"""Regenerate the argument tables of ``docs/api.md`` from the code, or check that they are current.

    python docs/gen_api.py          # rewrite every generated block in docs/api.md
    python docs/gen_api.py --check  # exit 1 naming each missing or stale block (what the tests run)

``docs/api.md`` is hand-written prose with one generated block per public name: every name in
``deepep_lightning.__all__`` (except ``__version__``), the options of ``deepep-audit`` (one block
per sub-command) and ``deepep-compare``, and ``train.py``'s ``--model.*`` keys (the arguments of
``DeepEPModule``). A block sits between ``<!-- BEGIN GENERATED <key> -->`` and
``<!-- END GENERATED <key> -->`` and holds a table built from the signature (names, types, defaults;
the values of ``Literal`` types are the allowed values) and the ``Args:`` section of the docstring
(the meaning). The prose around the blocks is never touched: a new public name needs a
``### `name` `` section with a paragraph and an empty pair of markers, which this script fills.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import importlib
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
API_MD = REPO / "docs" / "api.md"
CLI_KEYS = ("deepep-audit l1", "deepep-audit l2", "deepep-audit l3", "deepep-audit l4", "deepep-compare")
TRAIN_KEY = "train.py"
_BLOCK = re.compile(r"<!-- BEGIN GENERATED (?P<key>[^>]+?) -->\n(?P<body>.*?)<!-- END GENERATED (?P=key) -->", re.S)


# ---------------------------------------------------------------- what is public
def public_objects() -> dict[str, Any]:
    """Every public name of ``deepep_lightning`` (``__all__`` without ``__version__``) and its object."""
    sys.path.insert(0, str(REPO))
    import deepep_lightning

    return {name: getattr(deepep_lightning, name) for name in deepep_lightning.__all__ if name != "__version__"}


def parameters(obj: Any) -> list[inspect.Parameter]:
    """The constructor (class) or call (function) parameters a user passes; none for an exception."""
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return []
    return [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """The argparse parser of each CLI key (``deepep-audit`` has one per sub-command)."""
    from deepep_lightning.audit.cli import _parser as audit_parser
    from deepep_lightning.compare.cli import _parser as compare_parser

    parsers = {}
    for action in audit_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parsers[f"deepep-audit {name}"] = sub
    parsers["deepep-compare"] = compare_parser()
    return parsers


def cli_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def train_module() -> type:
    from deepep_lightning.deepep import DeepEPModule

    return DeepEPModule


# ---------------------------------------------------------------- rendering
def markdown(text: str) -> str:
    """rST from a docstring as Markdown inside a table cell."""
    # :class:`~a.b.C` shows as `C` (Sphinx's tilde), :class:`a.b.C` as `a.b.C`
    text = re.sub(
        r":(?:class|func|meth|data|attr|mod|exc):`(~?)([^`]+)`",
        lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`",
        text,
    )
    return text.replace("``", "`").replace("|", "\\|").strip()


def docstring_args(obj: Any) -> dict[str, str]:
    """``{argument: meaning}`` from the ``Args:`` section; ``a / b:`` and ``a, b:`` entries name several."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return {}
    base = len(lines[start]) - len(lines[start].lstrip())
    entries: list[tuple[list[str], list[str]]] = []
    entry_indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= base:
            break
        entry_indent = indent if entry_indent is None else entry_indent
        match = re.match(r"([*\w][\w\s,/*]*?):(\s.*|)$", line.strip())
        if indent == entry_indent and match:
            names = [n.strip().lstrip("*") for n in re.split(r"[,/]", match.group(1))]
            entries.append((names, [match.group(2).strip()]))
        elif entries:
            entries[-1][1].append(line.strip())
    return {name: " ".join(text).strip() for names, text in entries for name in names}


def render_type(hint: Any) -> str:
    """A type hint as a user reads it; a ``Literal`` lists its allowed values."""
    if hint is type(None):
        return "None"
    if hint is Ellipsis:
        return "..."
    if isinstance(hint, list):
        return "[" + ", ".join(render_type(h) for h in hint) + "]"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(render_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if origin is collections.abc.Callable:
            name = "Callable"
        return f"{name}[{', '.join(render_type(a) for a in args)}]" if args else name
    if hint is typing.Any:
        return "Any"
    if isinstance(hint, type):
        name = hint.__name__
        if hint.__module__.split(".")[0] == "torch":  # the public path: torch.nn.Module, not torch.nn.modules...
            for public in ("torch", "torch.nn", "torch.utils.data", "torch.optim"):
                if getattr(importlib.import_module(public), name, None) is hint:
                    return f"{public}.{name}"
        return name
    return str(hint).replace("typing.", "")


def _hints(obj: Any) -> dict[str, Any]:
    # a class's hints are its __init__'s; a dataclass's are its fields'
    target = obj.__init__ if isinstance(obj, type) and not dataclasses.is_dataclass(obj) else obj  # type: ignore[misc]
    try:
        return typing.get_type_hints(target)
    except Exception:  # an annotation that names a TYPE_CHECKING-only import: keep the strings
        return {}


def render_default(parameter: inspect.Parameter, obj: Any) -> str:
    if parameter.kind is inspect.Parameter.VAR_POSITIONAL or parameter.kind is inspect.Parameter.VAR_KEYWORD:
        return ""
    fields = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    field = fields.get(parameter.name)
    if field is not None and field.default_factory is not dataclasses.MISSING:
        return f"`{getattr(field.default_factory, '__name__', 'factory')}()`"
    if parameter.default is inspect.Parameter.empty:
        return "required"
    default = parameter.default
    if isinstance(default, (set, frozenset)):  # a set's repr follows PYTHONHASHSEED: sort it
        text = f"{type(default).__name__}({{{', '.join(sorted(repr(v) for v in default))}}})"
    else:
        text = repr(default)
    return f"`{text}`".replace("|", "\\|")


def argument_table(obj: Any) -> str:
    """The generated block of one public class or function."""
    if isinstance(obj, type) and issubclass(obj, BaseException):
        bases = ", ".join(f"`{b.__name__}`" for b in obj.__bases__)
        return f"Exception; subclass of {bases}. Raised, not constructed by users.\n"
    column = "field" if dataclasses.is_dataclass(obj) else "argument"
    rows = [f"| {column} | type | default | meaning |", "|---|---|---|---|", *argument_rows(obj)]
    lines = [] if len(rows) > 2 else ["No arguments.", ""]
    if not (isinstance(obj, type)):
        returns = inspect.signature(obj).return_annotation
        hint = typing.get_type_hints(obj).get("return", returns) if returns is not inspect.Signature.empty else None
        if hint is not None:
            lines += [f"Returns `{render_type(hint)}`.", ""]
    return "\n".join(lines + (rows if len(rows) > 2 else [])) + "\n"


def argument_rows(obj: Any, prefix: str = "", names: collections.abc.Sequence[str] | None = None) -> list[str]:
    """One table row per parameter of ``obj`` (those in ``names``, when given), its name after ``prefix``."""
    hints, meanings = _hints(obj), docstring_args(obj)
    rows = []
    for p in parameters(obj):
        if names is not None and p.name not in names:
            continue
        name = prefix + {"VAR_POSITIONAL": f"*{p.name}", "VAR_KEYWORD": f"**{p.name}"}.get(p.kind.name, p.name)
        if p.name in hints:
            kind = render_type(hints[p.name])
        elif p.annotation is not inspect.Parameter.empty:
            kind = str(p.annotation)
        else:
            kind = ""
        meaning = markdown(meanings.get(p.name, ""))
        rows.append(
            f"| `{name}` | {'`' + kind.replace('|', chr(92) + '|') + '`' if kind else ''} | "
            f"{render_default(p, obj)} | {meaning} |"
        )
    return rows


def train_keys() -> list[str]:
    """``train.py``'s ``--model.*`` keys: each group's fields (``env.num_envs``) and the module's other arguments."""
    from deepep_lightning.deepep.config import GROUPS

    keys = [f"{group}.{p.name}" for group, kind in GROUPS.items() for p in parameters(kind)]
    return keys + [p.name for p in parameters(train_module()) if p.name not in GROUPS]


def train_table() -> str:
    """The generated block of ``train.py``'s ``--model.*`` keys, group by group."""
    from deepep_lightning.deepep.config import GROUPS

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for group, kind in GROUPS.items():
        rows += argument_rows(kind, prefix=f"{group}.")
    rows += argument_rows(train_module(), names=[p.name for p in parameters(train_module()) if p.name not in GROUPS])
    return "\n".join(rows) + "\n"


def option_table(parser: argparse.ArgumentParser) -> str:
    """The generated block of one CLI (sub-)command: every option with its default and choices."""
    rows = ["| option | value | default | meaning |", "|---|---|---|---|"]
    for action in cli_options(parser):
        flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.metavar or action.dest}`"
        if action.option_strings and action.nargs == 0:
            value = "flag"
        elif action.choices:
            value = " \\| ".join(f"`{c}`" for c in action.choices)
        else:
            value = f"`{action.metavar or action.dest.upper()}`" + (" ..." if action.nargs in ("+", "*") else "")
        default = "" if action.default in (None, False) or not action.option_strings else f"`{action.default!r}`"
        if not action.option_strings:
            default = "required"
        help_text = (action.help or "").replace("|", "\\|")
        rows.append(f"| {flags} | {value} | {default} | {help_text} |")
    return "\n".join(rows) + "\n"


def generated_blocks() -> dict[str, str]:
    """What every generated block of ``docs/api.md`` must hold, by key."""
    blocks = {name: argument_table(obj) for name, obj in public_objects().items()}
    blocks.update({key: option_table(parser) for key, parser in cli_parsers().items()})
    blocks[TRAIN_KEY] = train_table()
    return blocks


# ---------------------------------------------------------------- checking and rewriting
def blocks_in(text: str) -> dict[str, str]:
    return {m.group("key"): m.group("body") for m in _BLOCK.finditer(text)}


def problems(text: str, expected: dict[str, str] | None = None) -> list[str]:
    """Every way ``text`` (docs/api.md) falls behind the code: missing, unknown or stale blocks."""
    expected = generated_blocks() if expected is None else expected
    found = blocks_in(text)
    issues = [f"no generated block for {key!r} (add a section and its markers)" for key in expected if key not in found]
    issues += [f"a generated block for {key!r}, which is not public" for key in found if key not in expected]
    issues += [f"the block for {key!r} is stale" for key in expected if key in found and found[key] != expected[key]]
    return issues


def regenerate(text: str, expected: dict[str, str] | None = None) -> str:
    expected = generated_blocks() if expected is None else expected

    def fill(match: re.Match[str]) -> str:
        key = match.group("key")
        body = expected.get(key, match.group("body"))
        return f"<!-- BEGIN GENERATED {key} -->\n{body}<!-- END GENERATED {key} -->"

    return _BLOCK.sub(fill, text)


def sections(text: str) -> Iterator[tuple[str, str]]:
    """``(heading, body)`` of every ``###`` section, the body up to the next heading."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        if heading.startswith("### "):
            yield heading[4:].strip(), body


def main(argv: list[str] | None = None, output: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="only report missing or stale blocks (exit 1)")
    parser.add_argument("--file", type=Path, default=API_MD, help="the reference to check or rewrite")
    args = parser.parse_args(argv)
    text = args.file.read_text()
    expected = generated_blocks()
    found = problems(text, expected)
    # without --check, stale blocks are rewritten; a missing or unknown section needs prose, which only a person writes
    reported = found if args.check else [p for p in found if "stale" not in p]
    for problem in reported:
        output(f"{args.file}: {problem}")
    if reported:
        return 1
    new = regenerate(text, expected)
    if new != text:
        args.file.write_text(new)
        output(f"{args.file}: regenerated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
