"""The committed JSON Schema matches the models, and the shipped configs follow it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from testbed.config.schema import SCHEMA_DIALECT, fabric_schema, schema_text
from tests.conftest import REPO

SCHEMA_PATH = REPO / "configs" / "schema" / "fabric.schema.json"
MODELINE_RE = re.compile(r"^# yaml-language-server: \$schema=(?P<path>\S+)\s*$")
REGENERATE = "python -m testbed.config.schema > configs/schema/fabric.schema.json"


def example_configs() -> list[Path]:
    """configs/*.yaml, configs/examples/**/*.yaml and configs/collectives/*.yaml: the files
    users copy from."""
    configs = REPO / "configs"
    return sorted([*configs.glob("*.yaml"), *(configs / "examples").rglob("*.yaml"),
                   *(configs / "collectives").glob("*.yaml")])


def schema_of(path: Path) -> Path | None:
    """The schema a config's first line points its editor at, resolved; None if none."""
    with path.open(encoding="utf-8") as f:
        m = MODELINE_RE.match(f.readline())
    return (path.parent / m["path"]).resolve() if m else None


def test_committed_schema_is_what_the_models_generate() -> None:
    assert SCHEMA_PATH.exists(), f"no {SCHEMA_PATH}; generate it: {REGENERATE}"
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text(), (
        f"configs/schema/fabric.schema.json is stale; regenerate it: {REGENERATE}")


def test_schema_names_its_dialect_and_says_what_it_is() -> None:
    schema = fabric_schema()
    assert schema["$schema"] == SCHEMA_DIALECT == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"]
    assert "testbed validate" in schema["description"]
    assert schema["required"] == ["name"]
    assert schema["additionalProperties"] is False


def _keys(node) -> set[str]:
    if isinstance(node, dict):
        return set(node).union(*(_keys(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_keys(v) for v in node))
    return set()


def test_quantity_fields_accept_strings_with_units_and_bare_numbers() -> None:
    props = fabric_schema()["$defs"]["LinkSpec"]["properties"]
    assert {alt["type"] for alt in props["length"]["anyOf"]} == {"string", "number"}
    rate = fabric_schema()["properties"]["max_wall_port_rate"]
    assert "100Gbps" in str(rate)


def test_schema_uses_only_json_schema_range_keywords() -> None:
    # pydantic writes the constraints of validator-wrapped types as ge/gt/le/lt,
    # which no JSON Schema validator knows; models.py gives those types a schema.
    assert not {"ge", "gt", "le", "lt"} & _keys(fabric_schema())


@pytest.mark.parametrize("path", example_configs(), ids=lambda p: str(p.relative_to(REPO)))
def test_example_config_points_its_editor_at_a_schema(path: Path) -> None:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert MODELINE_RE.match(first), (
        f"{path.relative_to(REPO)}: the first line should be "
        "'# yaml-language-server: $schema=<relative path to its schema>'")
    target = schema_of(path)
    assert target is not None and target.exists(), f"{path}: {target} does not exist"


def test_default_config_uses_the_fabric_schema() -> None:
    assert schema_of(REPO / "configs" / "default.yaml") == SCHEMA_PATH


@pytest.mark.parametrize("path", [p for p in example_configs() if schema_of(p) == SCHEMA_PATH],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_fabric_config_validates_against_the_schema(path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(fabric_schema()).validate(data)


@pytest.mark.parametrize("name", ["unknown_top_level_field", "length_unknown_unit",
                                  "dilation_zero", "bad_lab_name", "node_role_typo"])
def test_schema_rejects_what_validate_rejects_field_by_field(name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    path = REPO / "tests" / "config_errors" / f"{name}.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if name == "length_unknown_unit":
        # The schema checks a quantity's shape, not its unit: that is validate's job.
        data["topology"]["host_link"]["length"] = "three metres"
    validator = jsonschema.Draft202012Validator(fabric_schema())
    assert list(validator.iter_errors(data)), f"the schema accepts {name}.yaml"


def test_schema_is_itself_valid() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(fabric_schema())
