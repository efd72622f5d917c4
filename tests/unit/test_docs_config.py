"""docs/config.md's field tables are what the config models generate, so they cannot drift.

The tables are rendered by testbed/config/docs.py (`make docs`); these tests fail when
the committed file is stale, when a model is not reached by the walk (a config field
nobody documents), when the traffic models miss a workload kind the loader accepts,
and they check the renderer's types, units and defaults against the parsers.
"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field, ValidationError

import testbed.config.models as models
from testbed.config import docs
from testbed.config.models import DurationNs, PortClass, SizeBytes, Workload
from testbed.plan.qos import DEFAULT_BUFFER_BYTES
from testbed.units import format_size
from tests.conftest import REPO

CONFIG_MD = REPO / "docs" / "config.md"
REGENERATE = "make docs (python -m testbed.config.docs --write docs/config.md)"


def test_committed_tables_are_what_the_models_generate() -> None:
    text = CONFIG_MD.read_text(encoding="utf-8")
    assert docs.generate(text) == text, f"docs/config.md is stale; regenerate it: {REGENERATE}"


def test_check_mode_exits_1_with_a_diff_on_a_stale_file(tmp_path, capsys) -> None:
    stale = tmp_path / "config.md"
    stale.write_text(CONFIG_MD.read_text(encoding="utf-8").replace(
        "| `reserve` |", "| `reserved` |"), encoding="utf-8")
    assert docs.main(["--check", str(stale)]) == 1
    out = capsys.readouterr().out
    assert "-| `reserved` |" in out and "+| `reserve` |" in out
    assert docs.main(["--write", str(stale)]) == 0
    assert docs.main(["--check", str(stale)]) == 0
    assert stale.read_text(encoding="utf-8") == CONFIG_MD.read_text(encoding="utf-8")


def _config_models() -> set[type[BaseModel]]:
    """Every model with fields that testbed/config/models.py defines, and the traffic models."""
    found = {obj for obj in vars(models).values()
             if isinstance(obj, type) and issubclass(obj, BaseModel)
             and obj.__module__ == models.__name__ and obj.model_fields}
    return found | set(docs.traffic_models().values())


def test_every_config_model_has_a_table() -> None:
    reached = {t.model for t in docs.collect_tables()}
    missing = sorted(m.__name__ for m in _config_models() - reached)
    assert not missing, f"the walk from Fabric does not reach {missing}: their fields have no table"


def test_every_table_has_a_row_per_field_keyed_as_the_yaml_writes_it() -> None:
    for table in docs.collect_tables():
        keys = [r.key for r in table.rows]
        assert keys == [f.alias or n for n, f in table.model.model_fields.items()], table.key


def _kinds_the_loader_accepts() -> set[str]:
    """The traffic kinds `workload.traffic` validates, read from its unknown-kind error."""
    with pytest.raises(ValidationError) as info:
        Workload.model_validate({"traffic": [{"kind": "no_such_kind"}]})
    (error,) = [e for e in info.value.errors() if e["loc"][-1] == "kind"]
    listed = error["msg"].split("use one of ", 1)[1]
    return {k.strip() for k in listed.split(",")}


def test_traffic_models_cover_every_kind_the_loader_accepts() -> None:
    kinds = _kinds_the_loader_accepts()
    assert kinds >= {"udp_incast", "roce_incast"}
    assert set(docs.traffic_models()) == kinds


def test_each_traffic_model_gets_one_table_naming_its_kinds() -> None:
    by_model: dict[type[BaseModel], set[str]] = {}
    for kind, model in docs.traffic_models().items():
        by_model.setdefault(model, set()).add(kind)
    tables = {t.model: t for t in docs.collect_tables()}
    for model, kinds in by_model.items():
        assert set(tables[model].kinds) == kinds
        assert tables[model].paths == ["workload.traffic[]"]
        assert all(f"`{k}`" in docs.render_table(tables[model]) for k in kinds)


def test_the_tables_the_issue_found_missing_are_there() -> None:
    regions = docs.render_regions()
    text = CONFIG_MD.read_text(encoding="utf-8")
    for model in ("Impairment", "SwitchBuffer", "DcqcnCcParams", "DctcpCcParams"):
        assert model in regions
        assert docs.BEGIN.format(key=model) in text
    assert "**`impairments[]`**" in regions["Impairment"]
    assert "**`workload.traffic[].cc_params`" in regions["DcqcnCcParams"]


def _row(model: str, key: str) -> docs.Row:
    table = next(t for t in docs.collect_tables() if t.model.__name__ == model)
    return next(r for r in table.rows if r.key == key)


@pytest.mark.parametrize(("model", "key", "type_", "default", "unit"), [
    ("Fabric", "max_wall_port_rate", "rate", "unset", "bit/s, wall"),
    ("Fabric", "mtu", "integer 1280..9216", "`9000`", "bytes"),
    ("Fabric", "dilation", "integer >= 1 or `auto`", "`auto`", ""),
    ("Fabric", "qos", "mapping from names to mappings: `qos.<name>`", "`{default: {}}`", ""),
    ("SwitchBuffer", "reserve", "size", "`4KiB`", "bytes"),
    ("SwitchBuffer", "size", "size", "required", "bytes"),
    ("PfcConfig", "watchdog", "duration", "unset", "ns, fabric time"),
    ("PortClass", "ecn", "mapping: `qos.<name>.ecn`", "`{kmin: 100KB, kmax: 400KB, pmax: 0.2}`",
     ""),
    ("LinkSpec", "length", "length", "required", "m"),
    ("DcqcnCcParams", "byte_counter", "size or `none`", "unset", "bytes"),
    ("Impairment", "direction", "`both`, `forward`, `reverse`", "`both`", ""),
])
def test_rows_say_type_default_and_unit_as_the_parsers_read_them(
        model: str, key: str, type_: str, default: str, unit: str) -> None:
    row = _row(model, key)
    assert (row.type, row.default, row.unit) == (type_, default, unit)


def test_topology_kinds_each_get_a_table() -> None:
    tables = {t.model.__name__: t for t in docs.collect_tables()}
    assert {tables[m].kinds for m in ("LeafSpine", "SingleSwitch", "Ring")} == {
        ("leaf_spine",), ("single_switch",), ("ring",)}
    assert _row("Fabric", "topology").type == (
        "mapping by `kind` (`leaf_spine`, `single_switch`, `ring`): `topology`")
    assert set(tables["LinkSpec"].paths) == {"topology.host_link", "topology.fabric_link"}


def test_a_unit_suffix_that_contradicts_the_parser_is_an_error() -> None:
    class Bad(BaseModel):
        delay_ns: SizeBytes = Field(0, description="named ns, parsed as a size")

    with pytest.raises(ValueError, match="delay_ns: the name says ns but the value is parsed"):
        docs.collect_tables(Bad)


def test_a_type_the_renderer_does_not_know_is_an_error_not_a_guess() -> None:
    class Odd(BaseModel):
        when: complex = Field(0j, description="no human name for this")

    with pytest.raises(TypeError, match="when: no human name"):
        docs.collect_tables(Odd)


def test_regions_keep_the_prose_and_must_match_the_tables() -> None:
    class Small(BaseModel):
        """A small model."""

        mode: Literal["a", "b"] = Field("a", description="the mode")
        period_ns: DurationNs = Field(2000, description="a period")

    begin, end = docs.BEGIN.format(key="Small"), docs.END.format(key="Small")
    text = f"# Title\n\nProse before.\n\n{begin}\nold table\n{end}\n\nProse after.\n"
    out = docs.apply_regions(text, docs.render_regions(Small))
    assert out.startswith("# Title\n\nProse before.\n\n" + begin + "\n**Top level**: A small")
    assert out.endswith(end + "\n\nProse after.\n")
    assert "| `period_ns` | duration | `2us` | ns, fabric time | a period |" in out
    assert "old table" not in out
    with pytest.raises(ValueError, match="no region for Small"):
        docs.apply_regions("# no regions\n", docs.render_regions(Small))
    stray = docs.BEGIN.format(key="Gone") + "\n" + docs.END.format(key="Gone")
    with pytest.raises(ValueError, match="regions without a model: Gone"):
        docs.apply_regions(text + stray, docs.render_regions(Small))


def test_cells_escape_pipes_and_tag_like_text_outside_code() -> None:
    assert docs._cell("a | b") == "a \\| b"
    assert docs._cell("tb-<name>-<node>, `qos.<name>`, <= 8") == (
        "tb-&lt;name>-&lt;node>, `qos.<name>`, <= 8")


def test_the_buffer_defaults_the_description_states_are_the_plans() -> None:
    size = {k: format_size(v) for k, v in DEFAULT_BUFFER_BYTES.items()}
    assert (f"gets {size['lossless']} if lossless, {size['strict']} if strict, else "
            f"{size['lossy']}") in PortClass.model_fields["buffer"].description


def test_the_undocumented_list_names_fields_without_a_description() -> None:
    names = docs.undocumented()
    every = {f"{t.model.__name__}.{r.key}" for t in docs.collect_tables() for r in t.rows}
    assert set(names) <= every
    assert "Fabric.name" not in names          # it has one
    for name in names:
        model, key = name.split(".")
        assert not _row(model, key).description
