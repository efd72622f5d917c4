"""docs/config.md documents every field a config may hold, so docs and models cannot drift.

A field counts as documented when docs/config.md names it as code (`` `window` ``) or
writes it as a YAML key (`window:`). Every model of testbed/config/models.py and of each
workload kind is checked, and every `cc_params` key of both congestion controls.
"""

from __future__ import annotations

import re

import pytest
from pydantic import BaseModel

import testbed.config.models as models
from testbed.workloads import roce_params
from testbed.workloads.registry import REGISTRY
from testbed.workloads.roce_params import CC_PARAMS_MODELS, cc_param_keys
from tests.conftest import REPO

CONFIG_DOC = (REPO / "docs" / "config.md").read_text(encoding="utf-8")


def _documented(name: str) -> bool:
    as_key = re.search(rf"[{{,\s]{re.escape(name)}:", CONFIG_DOC)
    return f"`{name}`" in CONFIG_DOC or as_key is not None


def _config_models() -> list[type[BaseModel]]:
    """Every model of the config, the workload kinds' entries and their cc_params."""
    found = [obj for module in (models, roce_params) for obj in vars(module).values()
             if isinstance(obj, type) and issubclass(obj, BaseModel)
             and obj.__module__ == module.__name__ and obj.model_fields]
    return found + [k.model for k in REGISTRY.kinds()]


@pytest.mark.parametrize("model", _config_models(), ids=lambda m: m.__name__)
def test_every_config_field_is_in_docs_config_md(model: type[BaseModel]) -> None:
    missing = [f.alias or n for n, f in model.model_fields.items()
               if not _documented(f.alias or n)]
    assert not missing, f"{model.__name__}: document {missing} in docs/config.md"


@pytest.mark.parametrize("cc", sorted(CC_PARAMS_MODELS))
def test_every_cc_params_key_is_in_the_cc_params_table(cc: str) -> None:
    table = CONFIG_DOC[CONFIG_DOC.index("| `cc: dcqcn` key"):]
    table = table[:table.index("\n\n")]
    missing = [k for k in cc_param_keys(cc) if f"`{k}`" not in table]
    assert not missing, f"cc: {cc}: add {missing} to the cc_params table of docs/config.md"
