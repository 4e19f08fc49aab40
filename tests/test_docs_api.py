"""docs/api.md documents every public name, every constructor/call argument and every CLI option, as the code has them.

Two independent checks: the generated tables equal what ``docs/gen_api.py`` builds from the code now (types,
defaults, meanings), and, without the generator, every public name has a section with prose and every
argument and option has a row in it. Each check is shown to fail on a doctored copy of the reference.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
API_MD = REPO / "docs" / "api.md"
FIX = "HINT: run `python docs/gen_api.py` (and write the prose of a new section by hand)"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_api", REPO / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_api = _load_generator()


def _sections(text: str) -> dict[str, str]:
    return {heading.strip("`"): body for heading, body in gen_api.sections(text)}


def _prose(body: str) -> str:
    """A section without its generated block."""
    return re.sub(r"<!-- BEGIN GENERATED.*?<!-- END GENERATED [^>]*-->", "", body, flags=re.S).strip()


def _row_names(body: str) -> set[str]:
    """The first cell of every table row: `name`, `*args`, `--flag, --alias`."""
    names = set()
    for line in body.splitlines():
        match = re.match(r"\| (`[^|]*`) \|", line)
        if match:
            names.update(re.findall(r"`([^`]+)`", match.group(1)))
    return names


def undocumented(text: str) -> list[str]:
    """Public names without a section or prose, and arguments/options without a row: read from the code directly."""
    sections = _sections(text)
    missing = []
    for name, obj in gen_api.public_objects().items():
        if name not in sections:
            missing.append(f"no section for {name!r}")
            continue
        if len(_prose(sections[name]).split()) < 15:
            missing.append(f"the section for {name!r} has no paragraph")
        rows = _row_names(sections[name])
        for parameter in gen_api.parameters(obj):
            shown = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(parameter.kind.name, "") + parameter.name
            if shown not in rows:
                missing.append(f"{name}: argument {shown!r} has no row")
    cli = {key: sections.get(key.split()[0], "") for key in gen_api.CLI_KEYS}
    for key, parser in gen_api.cli_parsers().items():
        rows = _row_names(cli.get(key, ""))
        for action in gen_api.cli_options(parser):
            for flag in action.option_strings or [action.metavar or action.dest]:
                if flag not in rows:
                    missing.append(f"{key}: option {flag!r} has no row")
    train_rows = _row_names(sections.get(gen_api.TRAIN_KEY, ""))
    for key in gen_api.train_keys():
        if key not in train_rows:
            missing.append(f"train.py: --model.{key} has no row")
    return missing


@pytest.fixture(scope="module")
def text() -> str:
    return API_MD.read_text()


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    return gen_api.generated_blocks()


def test_generated_tables_match_the_code(text, expected):
    problems = gen_api.problems(text, expected)
    assert not problems, "\n".join(problems) + "\n" + FIX


def test_every_public_name_argument_and_option_is_documented(text):
    missing = undocumented(text)
    assert not missing, "\n".join(missing) + "\n" + FIX


def sections_of_non_public_names(text: str) -> set[str]:
    """Sections whose heading is neither a public name nor a command-line tool."""
    import deepep_lightning

    public = set(deepep_lightning.__all__) - {"__version__"}
    tools = {key.split()[0] for key in gen_api.CLI_KEYS} | {gen_api.TRAIN_KEY}
    return set(_sections(text)) - public - tools


def test_no_section_documents_a_name_that_is_not_public(text):
    """A name removed from ``__all__`` leaves no section behind."""
    assert not sections_of_non_public_names(text)


def test_a_section_of_a_removed_name_is_caught(text):
    """Negative control: a section for a name the package does not export."""
    doctored = text.replace("## Ops\n", "## Ops\n\n### `removed_name`\n\nGone.\n", 1)
    assert sections_of_non_public_names(doctored) == {"removed_name"}


def test_a_missing_argument_row_is_caught(text):
    """Negative control: the independent check notices a deleted row."""
    doctored = re.sub(r"^\| `snapshot_every_n_steps` \|.*\n", "", text, count=1, flags=re.M)
    assert doctored != text
    assert "NaNRollbackCallback: argument 'snapshot_every_n_steps' has no row" in undocumented(doctored)


def test_a_stale_default_is_caught(text, expected):
    """Negative control: a default that differs from the signature makes that block stale."""
    doctored = text.replace("| `check_every_n_steps` | `int` | `10` |", "| `check_every_n_steps` | `int` | `1` |", 1)
    assert doctored != text
    # compared with the reference's own findings, so the control holds while another block is being updated
    baseline = gen_api.problems(text, expected)
    new = [p for p in gen_api.problems(doctored, expected) if p not in baseline]
    assert new == ["the block for 'NumericalHealthCallback' is stale"]
    assert gen_api.problems(gen_api.regenerate(doctored, expected), expected) == []


def test_a_missing_section_and_a_new_public_name_are_caught(text, expected):
    """Negative controls: a deleted section, and a public name the reference has never heard of."""
    start = text.index("### `derive_seed`")
    doctored = text[:start] + text[text.index("### `make_generator`") :]
    assert "no section for 'derive_seed'" in undocumented(doctored)
    assert "no generated block for 'derive_seed' (add a section and its markers)" in gen_api.problems(
        doctored, expected
    )
    assert "no generated block for 'brand_new_name' (add a section and its markers)" in gen_api.problems(
        text, {**expected, "brand_new_name": "| argument |\n"}
    )


def test_a_missing_cli_option_is_caught(text):
    doctored = re.sub(r"^\| `--resume-at` \|.*\n", "", text, count=1, flags=re.M)
    assert "deepep-audit l4: option '--resume-at' has no row" in undocumented(doctored)


def test_docstring_args_reads_grouped_and_continued_entries():
    def documented(a, b, c, d, *keys, **kwargs):
        """Summary.

        Args:
            a: first line
                continued.
            b / c: shared meaning.
            d: ``code`` and :class:`~x.y.Z`.
            *keys: the keys.
            **kwargs: the rest.

        Raises:
            ValueError: never an argument.
        """

    meanings = gen_api.docstring_args(documented)
    assert meanings == {
        "a": "first line continued.",
        "b": "shared meaning.",
        "c": "shared meaning.",
        "d": "``code`` and :class:`~x.y.Z`.",
        "keys": "the keys.",
        "kwargs": "the rest.",
    }
    assert gen_api.markdown(meanings["d"]) == "`code` and `Z`."
    assert gen_api.markdown("a | b") == "a \\| b"


def test_types_render_with_their_allowed_values():
    from typing import Literal

    import torch

    assert gen_api.render_type(Literal["raise", "warn"] | None) == "'raise' | 'warn' | None"
    assert gen_api.render_type(torch.nn.Module) == "torch.nn.Module"
    assert gen_api.render_type(torch.utils.data.Dataset) == "torch.utils.data.Dataset"
    assert gen_api.render_type(list[int]) == "list[int]"


def test_the_check_command_names_exactly_the_stale_block_under_another_hash_seed(tmp_path, text, expected, run_process):
    """``--check`` on a copy with one stale default exits 1 naming that block and no other than this process
    finds: under another PYTHONHASHSEED the rest still matches (a set default is rendered sorted)."""
    stale = tmp_path / "api.md"
    doctored = text.replace("| `window` | `int` | `100` |", "| `window` | `int` | `99` |", 1)
    stale.write_text(doctored)
    findings = gen_api.problems(doctored, expected)
    assert "the block for 'LossSpikeDetector' is stale" in findings
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    command = [sys.executable, str(REPO / "docs" / "gen_api.py"), "--check", "--file", str(stale)]
    result = run_process(command, env=env, cwd=REPO)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"{stale}: {finding}" for finding in findings]
