"""docs/config.md is generated from the schema; this keeps them in sync."""

from pathlib import Path

from roll_core.config.reference import config_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_reference_is_up_to_date() -> None:
    assert DOC.read_text() == config_reference() + "\n", (
        "docs/config.md is stale: regenerate with `roll schema > docs/config.md`"
    )


def test_every_field_is_documented() -> None:
    text = config_reference()
    assert "| `trainer.max_steps` | int | **required** |" in text
    assert "|  |" not in text.replace("| section |", "")  # no empty description cell
