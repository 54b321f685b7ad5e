"""Validation of the simulator against real runs, one concern per module:

- ``run``: ``validate_plan`` and ``validate_record``, the whole validation (start here);
- ``profiling``: the plan's workload profiled as its ranks will run, the bundle a plan is validated with;
- ``comm``: a plan's message sizes and the two-rank communication benchmark of them;
- ``calibration``: ``ValidationCalibration``, its fit and the cost-model wrappers that apply it;
- ``compare``: prediction against measurement (iteration time, per-kind durations, peak memory);
- ``artifacts``: traces, the timeline figure and the prediction written beside the report;
- ``report``: ``ValidationReport`` and its Markdown form.

``python -m analysis.validate`` is the command line (``analysis/validate.py``).
"""
