"""The incident file's model: configs/incidents/NAME.yaml (docs/incidents.md).

An incident is a fabric config (validated by the normal config loader), a control variant
(dotted-path edits of that fabric), a signature (predicates that must all hold for the
incident to have reproduced) and the evidence the report plots. The predicates are data,
not code: a metric over the run's raw data (a counter series, a result row, a summary.json
field, an event count), an operator and a threshold, optionally scaled by the same metric
in the control run or by another metric of the same run.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from testbed.fields import Strict

Op = Literal["<", "<=", ">", ">=", "=="]
Stat = Literal["delta", "rate_bps", "rate", "max", "min", "last", "mean", "fraction_nonzero"]
Across = Literal["sum", "max", "min", "all", "any", "count"]
ResultAgg = Literal["sum", "max", "min", "mean", "count", "first", "last"]
# A number, or a quantity with a unit (25Gbps, 100KB, 2ms): the metric's base unit.
Threshold = float | int | str


class Window(Strict):
    """Fabric time after the workload's t0 (ts_fabric_ns 0): a duration (2ms), `start`
    (the first sample, before t0) or `end` (the last sample)."""

    from_: str | int = Field(0, alias="from", description="window start: a duration after "
                             "t0, `start` or `end` (default 0: t0)")
    to: str | int = Field("end", description="window end: a duration after t0, `start` or "
                          "`end` (default end: the last sample)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Each(Strict):
    """`across: count`: the condition a series must meet to be counted."""

    op: Op = ">"
    value: Threshold = 0


class CounterMetric(Strict):
    """A stat of every matching counter series, combined `across` them."""

    name: str = Field(description="the counter (docs/run-format.md), e.g. pause_rx")
    node: str = Field("*", description="node name or glob (leaf*, *)")
    port: str = Field("*", description="port (interface or agent name) or glob; '' for "
                      "node-wide counters")
    tclass: int | str = Field("*", description="traffic class number, class name (roce) or "
                              "'*'; -1: counters not per class")
    stat: Stat = Field("delta", description="per series over the window")
    window: Window = Field(default_factory=Window)
    across: Across = Field("sum", description="how the series' stats combine")
    each: Each | None = Field(None, description="across: count: the condition counted "
                              "(default > 0)")

    @model_validator(mode="after")
    def _each_only_with_count(self) -> CounterMetric:
        if self.each is not None and self.across != "count":
            raise ValueError("each: applies only to across: count")
        return self


class ResultMetric(Strict):
    """An aggregate of one field over the workload's result rows (the store's results)."""

    workload: str = Field("*", description="workload (traffic entry) name or glob")
    field: str = Field(description="result row column, e.g. rx_fabric_bps, gbps")
    agg: ResultAgg = "sum"
    where: dict[str, Any] = Field(default_factory=dict,
                                  description="only rows whose columns equal these "
                                              "(strings may be globs)")


class EventsMetric(Strict):
    """How many rows of the events table match."""

    kind: str = Field(description="event kind, e.g. pfc_xoff, fault, pfc_storm")
    node: str = "*"
    port: str = "*"
    detail_match: dict[str, Any] = Field(default_factory=dict,
                                         description="detail fields that must equal these "
                                                     "(strings may be globs)")
    window: Window = Field(default_factory=lambda: Window.model_validate({"from": "start"}))


METRIC_KEYS = ("counter", "result", "summary", "events")


class Metric(Strict):
    """Exactly one of counter, result, summary, events."""

    counter: CounterMetric | None = None
    result: ResultMetric | None = None
    summary: str | None = Field(None, description="dotted path into summary.json, e.g. "
                                "totals.drops; a list item by index or its name")
    events: EventsMetric | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Metric:
        given = [k for k in METRIC_KEYS if getattr(self, k) is not None]
        if len(given) != 1:
            shown = ", ".join(given) if given else "none"
            raise ValueError(f"give exactly one metric of {', '.join(METRIC_KEYS)} (got "
                             f"{shown})")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in METRIC_KEYS if getattr(self, k) is not None)


class Predicate(Metric):
    """`metric op value [x of]`: held iff the measured value compares so with the threshold."""

    name: str
    text: str | None = Field(None, description="the predicate in words (default: generated)")
    op: Op
    value: Threshold = Field(description="the threshold, or with `of` the factor")
    of: Literal["control"] | Metric | None = Field(
        None, description="control: the threshold is value x this metric in the control "
                          "run; a metric: value x that metric in this run")

    @field_validator("of", mode="before")
    @classmethod
    def _of(cls, value: object) -> object:
        # One message instead of one per member of the 'control' | Metric union.
        if isinstance(value, str) and value != "control":
            raise ValueError(f"must be control (the same metric in the control run) or a "
                             f"metric (counter:, result:, summary: or events:), got {value!r}")
        return value

    @model_validator(mode="after")
    def _factor_is_a_number(self) -> Predicate:
        if self.of is not None and not isinstance(self.value, int | float):
            raise ValueError(f"with of:, value is a plain factor (e.g. 0.5), got "
                             f"{self.value!r}")
        return self


class Evidence(Strict):
    """The counter series the report plots at the top, beside the verdict banner."""

    counter: str
    node: str = "*"
    port: str = "*"
    tclass: int | str = "*"
    caption: str


class Control(Strict):
    """The variant under which the signature must not hold: the fix, or no fault."""

    description: str
    set: dict[str, Any] = Field(default_factory=dict,
                                description="dotted fabric path -> new value")
    remove: list[str] = Field(default_factory=list, description="dotted fabric paths to "
                                                                "delete")


class Incident(Strict):
    title: str
    description: str = Field(description="what happens and why it matters")
    source: str = Field(description="the published account: paper or report, section")
    fault: str = Field(description="the fault or misconfiguration, in one line (what "
                       "`testbed incident list` shows)")
    fabric: dict[str, Any] = Field(description="a whole fabric config, as a fabric file")
    control: Control
    signature: list[Predicate] = Field(min_length=1)
    evidence: Evidence | None = None
