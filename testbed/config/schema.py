"""The JSON Schema of a fabric config, for editors and other tools.

Generated from the pydantic models, so it cannot drift from what `testbed
validate` accepts; the committed copy is checked by tests/unit/test_schema.py.
Regenerate it with

    python -m testbed.config.schema > configs/schema/fabric.schema.json

Config files point their editor at it with a first line such as
`# yaml-language-server: $schema=schema/fabric.schema.json` (path relative to
the file). The schema checks shapes, names and ranges; the whole-fabric checks
(links to unknown nodes, thresholds against buffers, PHY port types) remain
`testbed validate`'s.
"""

from __future__ import annotations

import json
import sys

from pydantic.json_schema import models_json_schema

from testbed.config.models import FORMAT_VERSION, Fabric
from testbed.workloads.registry import REGISTRY

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def fabric_schema() -> dict:
    """The fabric config schema as a JSON-serialisable dict (the YAML as written)."""
    schema = Fabric.model_json_schema(by_alias=True, mode="validation")
    _traffic_kinds(schema)
    return {
        "$schema": SCHEMA_DIALECT,
        **schema,
        "title": "Fabric testbed config",
        "description": (
            f"A fabric for `testbed validate/plan/up` (config format {FORMAT_VERSION}): "
            "a lab name, a topology (or nodes and links), traffic classes and port "
            "classes. Quantities are strings with units ('100Gbps', '2m', '512KB') or "
            "bare numbers in the base unit. Generated from testbed/config/models.py; "
            "`testbed validate` also checks the fabric as a whole."
        ),
    }


def _traffic_kinds(schema: dict) -> None:
    """A traffic entry is one of the registered kinds' models (the Fabric model holds only
    their common base, since kinds are registered, not listed in the model)."""
    models = [kind.model for kind in REGISTRY.kinds()]
    _, extra = models_json_schema([(m, "validation") for m in models], by_alias=True,
                                  ref_template="#/$defs/{model}")
    defs = schema["$defs"]
    defs.pop("TrafficEntry", None)
    defs.update(extra["$defs"])
    traffic = defs["Workload"]["properties"]["traffic"]
    traffic["items"] = {"anyOf": [{"$ref": f"#/$defs/{m.__name__}"} for m in models]}


def schema_text() -> str:
    """The schema file's exact contents: sorted keys, 2-space indent, final newline."""
    return json.dumps(fabric_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main() -> int:
    sys.stdout.write(schema_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
