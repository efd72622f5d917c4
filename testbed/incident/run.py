"""Run an incident: its control, then the incident, each judged against its signature.

`run_incident(loaded, options)` runs each variant with the normal run pipeline
(`testbed.run.runner.run_config`), evaluates the signature against the run directory's raw
data (the control run is the baseline of `of: control` predicates), writes `verdict` into
the run's summary.json and rebuilds its report so the report shows it. `judge_run` does
the last two steps for a run directory that already exists (`testbed incident judge`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from testbed.config import LoadedConfig
from testbed.incident.evaluate import build_verdict, evaluate_signature, open_run
from testbed.incident.load import LoadedIncident
from testbed.plan import compile_plan
from testbed.results.files import write_json
from testbed.run.runner import RunOptions, run_config


@dataclass
class VariantOutcome:
    variant: str
    run_dir: Path | None = None
    verdict: dict | None = None
    wall_s: float = 0.0
    interrupted: bool = False
    error: str | None = None

    @property
    def as_expected(self) -> bool:
        return bool(self.verdict and self.verdict["as_expected"]) and not self.interrupted


@dataclass
class IncidentOutcome:
    name: str
    title: str
    variants: dict[str, VariantOutcome] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every variant that was asked for ran and came out as expected: the incident
        reproduced and its control did not."""
        return bool(self.variants) and all(v.as_expected for v in self.variants.values())

    @property
    def interrupted(self) -> bool:
        return any(v.interrupted for v in self.variants.values())


def classes_of(loaded: LoadedConfig) -> dict[str, int]:
    return {c.name: c.tc for c in loaded.fabric.traffic_classes}


def allowed_of(loaded: LoadedConfig) -> list[str]:
    """The fabric's `allow:` list (checks turned into plan warnings on purpose)."""
    return [str(a) for a in (getattr(loaded.fabric, "allow", None) or [])]


def judge_run(incident: LoadedIncident, variant: str, run_dir: Path,
              baseline_dir: Path | None) -> dict:
    """Evaluate the signature on a finished run directory and write its verdict into
    summary.json (the report is the caller's to build). The baseline of `of: control` is
    `baseline_dir`, or for the control variant the run itself."""
    config = incident.variants[variant]
    classes = classes_of(config)
    baseline = baseline_dir if baseline_dir is not None else (
        run_dir if variant == "control" else None)
    with open_run(run_dir, classes) as run:
        if baseline is None:
            predicates = evaluate_signature(incident.incident.signature, run, None)
        elif Path(baseline) == Path(run_dir):
            predicates = evaluate_signature(incident.incident.signature, run, run)
        else:
            with open_run(Path(baseline), classes) as control:
                predicates = evaluate_signature(incident.incident.signature, run, control)
        verdict = build_verdict(
            name=incident.name, incident=incident.incident, variant=variant,
            predicates=predicates, allowed=allowed_of(config), classes=classes,
            baseline_run=str(baseline_dir) if baseline_dir is not None else None)
        summary = run.summary
    summary["verdict"] = verdict
    write_json(Path(run_dir) / "summary.json", summary)
    return verdict


def run_variant(incident: LoadedIncident, variant: str, options: RunOptions,
                baseline_dir: Path | None) -> VariantOutcome:
    out = VariantOutcome(variant)
    started = time.monotonic()
    config = incident.variants[variant]
    options.say(f"incident {incident.name}: running the {variant} variant")
    def judge(run_dir: Path) -> None:
        # between summary.json and the report, so the report is built once, with the verdict
        try:
            out.verdict = judge_run(incident, variant, run_dir, baseline_dir)
        except Exception as exc:   # the report is still written; say why it has no verdict
            out.error = f"the {variant} run could not be judged: {exc}"

    try:
        from testbed.run.calibration import load_capacity

        plan = compile_plan(config, max_wall_port_rate_bps=options.budget_bps,
                            capacity=load_capacity())
        result = run_config(config, plan, replace(options, before_report=judge))
    except Exception as exc:   # the next incident of a suite still runs; say why not this
        out.error = f"the {variant} run failed: {exc}"
        out.wall_s = time.monotonic() - started
        return out
    out.run_dir, out.interrupted = result.run_dir, result.interrupted
    if result.failed:      # the root cause, over any verdict judged on what little ran
        out.error = f"the {variant} run failed: {result.failed}"
    out.wall_s = time.monotonic() - started
    return out


def run_incident(incident: LoadedIncident, options: RunOptions,
                 control_only: bool = False) -> IncidentOutcome:
    """The control first (the incident's baseline), then the incident unless
    `control_only`; a variant interrupted stops the rest."""
    outcome = IncidentOutcome(incident.name, incident.incident.title)
    control = run_variant(incident, "control", options, None)
    outcome.variants["control"] = control
    if control_only or control.interrupted:
        return outcome
    outcome.variants["incident"] = run_variant(incident, "incident", options, control.run_dir)
    return outcome
