"""docs/api.md's settings table against ``Settings``: one row per field, with the flag the
CLI generates, the environment variable and the default, and no row for a setting that
does not exist. A new setting is its Settings field and its row here."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pydantic_settings")

from service.serve_cli import ENVIRONMENT_ONLY, flag
from service.settings import Settings

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def settings_rows(text: str) -> dict[str, list[str]]:
    """The table of ``## Settings``: its cells by the environment variable of each row."""
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("flag", "---"):
            continue
        variable = cells[1].strip("`")
        assert variable not in rows, f"two rows for {variable}"
        rows[variable] = cells
    return rows


def documented_default(default: object) -> str:
    """How the table writes a default: on/off for a switch, a whole float without ``.0``."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float) and default.is_integer():
        return f"`{int(default)}`"
    return f"`{default}`"


def test_every_setting_has_its_row_and_every_row_a_setting() -> None:
    rows = settings_rows(API.read_text("utf-8"))
    variables = {f"ATTNSERVE_{name.upper()}": name for name in Settings.model_fields}
    assert set(rows) == set(variables), (
        f"no row: {sorted(set(variables) - set(rows))}; "
        f"no setting: {sorted(set(rows) - set(variables))}")
    for variable, (flags, _, default, meaning) in rows.items():
        name = variables[variable]
        field = Settings.model_fields[name]
        expected = ("—" if name in ENVIRONMENT_ONLY
                    else f"`{flag(name)}` / `--no-{flag(name)[2:]}`"
                    if field.annotation is bool else f"`{flag(name)}`")
        assert flags == expected, name
        if field.is_required():
            assert default == "(required)", name
        elif field.get_default() is not None:
            assert default.startswith(documented_default(field.get_default())), (name, default)
        assert default and meaning, name


def test_the_table_reader_reads_rows_and_refuses_a_second_row_of_one_variable() -> None:
    text = ("\n## Settings\n\n| flag | environment | default | meaning |\n|---|---|---|---|\n"
            "| `--port` | `ATTNSERVE_PORT` | `8000` | bind port |\n\n## Next\n| x | y |\n")
    assert settings_rows(text) == {"ATTNSERVE_PORT": ["`--port`", "`ATTNSERVE_PORT`", "`8000`",
                                                      "bind port"]}
    with pytest.raises(AssertionError, match="two rows"):
        settings_rows(text.replace("\n\n## Next", "\n| `--port` | `ATTNSERVE_PORT` | 1 | x |"
                                                  "\n\n## Next"))
    assert documented_default(30.0) == "`30`" and documented_default(False) == "off"
