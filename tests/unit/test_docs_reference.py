"""The reference pages under docs/reference/ are what ``trainflow.docgen`` renders from the
spec and the parser: a field or an option changed without regenerating fails here."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from trainflow import docgen
from trainflow.cli import build_parser
from trainflow.spec import TrainingSpec

ROOT = docgen._ROOT
REGENERATE = f"stale reference page: run `{docgen.COMMAND}` and commit the result"


@pytest.mark.parametrize("page", sorted(docgen.pages()), ids=str)
def test_checked_in_page_is_the_rendered_one(page):
    path = ROOT / page
    assert path.exists(), f"{page} is missing: run `{docgen.COMMAND}`"
    assert path.read_text(encoding="utf-8") == docgen.pages()[page], f"{page}: {REGENERATE}"


def test_every_spec_field_has_exactly_one_row():
    text = (ROOT / docgen.CONFIGURATION).read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.MULTILINE)
    assert sorted(rows) == sorted(f.name for f in fields(TrainingSpec))


def test_every_subcommand_has_a_section():
    text = (ROOT / docgen.CLI).read_text(encoding="utf-8")
    names = [name for name, _, _ in docgen._subcommands(build_parser())]
    assert {"train", "submit", "simulate", "cancel"} <= set(names)
    for name in names:
        assert f"\n## trainflow {name}\n" in text, name


@pytest.mark.parametrize(
    "sections, error",
    [
        ({"Gang": ("nodes", "no_such_field")}, "'no_such_field', which is not a TrainingSpec field"),
        ({"Gang": ("nodes",), "Chip": ("nodes",)}, "'nodes' is in more than one of SECTIONS"),
    ],
    ids=["unknown-field", "field-twice"],
)
def test_sections_that_disagree_with_the_spec_are_refused(monkeypatch, sections, error):
    monkeypatch.setattr("trainflow.spec.SECTIONS", sections)
    with pytest.raises(ValueError, match=re.escape(error)):
        docgen.render_configuration()


def test_fields_in_no_section_come_first_as_in_the_trigger_form(monkeypatch):
    monkeypatch.setattr("trainflow.spec.SECTIONS", {"Gang": ("nodes",)})
    text = docgen.render_configuration()
    general, gang = text.index(f"## {docgen.TOP_SECTION}\n"), text.index("## Gang\n")
    assert general < text.index("| `steps` |") < gang < text.index("| `nodes` |")


def test_check_names_the_stale_pages_and_the_command(tmp_path, capsys):
    assert docgen.main(["--root", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / docgen.CLI).write_text("edited by hand\n", encoding="utf-8")
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(docgen.CLI) in err and str(docgen.CONFIGURATION) not in err
    assert docgen.COMMAND in err


@pytest.mark.parametrize("columns", ["40", "400"])
def test_the_page_does_not_depend_on_the_terminal_width(monkeypatch, columns):
    wide = docgen.render_cli()
    monkeypatch.setenv("COLUMNS", columns)  # argparse wraps usage lines to the terminal
    assert docgen.render_cli() == wide
