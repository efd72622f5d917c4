"""Incidents: known RoCE fabric failures reproduced on demand (docs/incidents.md).

    load_incident(path)            -> LoadedIncident   (the model + both validated variants)
    evaluate_signature(...)        -> list of predicate results (evaluate.py)
    run_incident(loaded, options)  -> IncidentOutcome  (run.py: control, then incident)

An incident file (configs/incidents/NAME.yaml) holds a fabric, a control variant and a
signature; the runner runs both, evaluates the signature against each run's raw data and
writes the verdict into its summary.json. This layer sits above `run`: it drives runs,
it is never driven by them.
"""
