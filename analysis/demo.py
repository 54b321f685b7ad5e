"""``paratwin demo``: the main job end to end on this machine, in a few minutes.

1. Profile the validation workload on this machine (one process per rank, as the runs will be) and
   benchmark its communication: the bundle every prediction below uses.
2. Search plans for the two local ranks: every registered choice, pruned, ranked by the estimate, the
   best simulated by the engine.
3. Run the search's best plan and a naive baseline (plain data parallelism) over gloo, and validate
   both: predicted against measured, instruction by instruction.
4. Ask a what-if of the analytic model: the README's paper-scale example plan.
5. Write a report (Markdown and a static HTML page) with the figures and the Perfetto traces.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from sim.plan import Plan

WHAT_IF_PLAN = Path(__file__).resolve().parent.parent / "examples" / "plans" / "gpt-8.3b-a100-64-merak.yaml"
# The validation workload (examples/validation/gpt-val-*.yaml): gpt-tiny widened so that a block costs
# ~10-20 ms per micro-batch of 4 on one CPU thread, so compute, not Python, dominates.
WORKLOAD = "gpt-tiny"
WORKLOAD_OPTIONS = {"hidden": 256, "heads": 4, "num_layers": 4, "seq": 128}
CLUSTER = {"preset": "local-cpu-2"}
MICRO_BATCH = 4  # the profile's: on a CPU a time does not scale linearly to another micro-batch
GLOBAL_BATCH = 16
ITERATIONS, WARMUP = 8, 2
WHAT_IF_FOLDER = "sim-gpt-8.3b-a100-64"
# What the demo writes in its folder: a folder of the user's holding one of these names is refused
# (report.md and report.html were overwritten).
DEMO_OUTPUTS = ("measure", "search", "validate", WHAT_IF_FOLDER, "report.md", "report.html")


@dataclass
class Validated:
    role: str
    plan: Plan
    report: object  # analysis.validation.report.ValidationReport


def baseline_plan() -> Plan:
    """What one would try first: plain data parallelism over the two ranks."""
    return Plan.from_dict({
        "name": "demo-baseline-dp2", "workload": WORKLOAD, "workload_options": WORKLOAD_OPTIONS,
        "cluster": CLUSTER, "parallelism": {"dp": 2},
        "schedule": {"name": "1f1b", "micro_batch": MICRO_BATCH, "microbatches": GLOBAL_BATCH // (2 * MICRO_BATCH)},
    })


def run_demo(out: Path, console: Console) -> None:
    from traces.outdir import OutputLock, prepare_out_folder

    prepare_out_folder(out, DEMO_OUTPUTS)  # before profiling; the demo's own folder is reused (its lock file)
    with OutputLock(out):
        _demo_in(out, console)


def _demo_in(out: Path, console: Console) -> None:
    """The demo's five steps, writing in ``out``, whose lock the caller holds."""
    from analysis.report import print_sim
    from analysis.search_report import print_search, write_search
    from analysis.validation.profiling import profile_for_validation
    from analysis.validation.report import format_report
    from analysis.validation.run import validate_plan
    from sim.search import SearchSpace, search
    from sim.simulate import simulate

    baseline = baseline_plan()

    console.rule("1/5 profile the validation workload and benchmark communication on this machine")
    with console.status("profiling two co-located processes, then gloo all-reduce and send/recv sweeps"):
        bundle = profile_for_validation(baseline, out / "measure")
    console.print(f"trace bundle with communication fits: {bundle}")

    console.rule("2/5 search plans for the two local ranks")
    space = SearchSpace(WORKLOAD, CLUSTER, global_batch=GLOBAL_BATCH, dtype="fp32",
                        workload_options=WORKLOAD_OPTIONS, profile=str(bundle), micro_batch_sizes=(MICRO_BATCH,))
    with console.status("enumerating, estimating, simulating the best plans"):
        result = search(space, top_k=20, sample=20)
    print_search(result, top=5)
    write_search(result, out / "search")
    if result.best is None:
        console.print("the search found no plan that fits; nothing to run")
        return
    best = result.plan_of(result.best.candidate, name="demo-searched-best")

    console.rule("3/5 run the searched plan and the naive baseline over gloo, and validate both")
    validated = []
    for role, plan in (("searched best", best), ("naive baseline", baseline)):
        same_profile = plan.micro_batch == MICRO_BATCH
        with console.status(f"{role}: {plan.name}: "
                            f"{'' if same_profile else 'profile at its micro-batch, '}run {WARMUP}+{ITERATIONS} "
                            "iterations, predict, compare"):
            report = validate_plan(plan, profile=bundle if same_profile else None, commbench=False,
                                   comm_fits_from=bundle, iterations=ITERATIONS, warmup=WARMUP,
                                   out_dir=out / "validate" / plan.name)
        console.print(f"{role}: predicted {report.predicted_s * 1e3:.1f} ms, measured {report.measured_s * 1e3:.1f} "
                      f"ms ({report.error:+.1%}); report {report.out_dir / 'report.md'}")
        validated.append(Validated(role, plan, report))

    console.rule(f"4/5 what if: GPT-8.3B on 64 A100s ({WHAT_IF_PLAN.name})")
    paper = Plan.load(WHAT_IF_PLAN)  # the README's example plan itself, so the two cannot disagree
    what_if = simulate(paper)
    print_sim(what_if)
    what_if.write(out / WHAT_IF_FOLDER)

    console.rule("5/5 report")
    markdown = demo_markdown(result, validated, format_report)
    (out / "report.md").write_text(markdown)
    (out / "report.html").write_text(demo_html(result, validated, out))
    console.print(f"report: {out / 'report.md'} and {out / 'report.html'}")


def _order(validated: list[Validated], key: str) -> list[str]:
    value = {"predicted": lambda v: v.report.predicted_s, "measured": lambda v: v.report.measured_s}[key]
    return [v.role for v in sorted(validated, key=value)]


# Predictions this close are one prediction: the search's engine and the validation's price one plan
# by the same profile (float rounding apart); two different plans a tie would be a coincidence.
PREDICTED_TIE_REL = 1e-9


def _same_plan(a: Plan, b: Plan) -> bool:
    return a.replace(name=b.name).model_dump(mode="json") == b.model_dump(mode="json")


def _verdict(validated: list[Validated]) -> str:
    predicted, measured = _order(validated, "predicted"), _order(validated, "measured")
    spreads = [v.report.measured["spread"] for v in validated]
    times = sorted(v.report.measured_s for v in validated)
    gap = times[-1] / times[0] - 1
    predictions = sorted(v.report.predicted_s for v in validated)
    if predictions[-1] - predictions[0] <= PREDICTED_TIE_REL * predictions[-1]:
        # No order was predicted, so none can be matched or contradicted (the search may pick the
        # baseline itself: then the two runs measure this machine's run-to-run spread).
        same = all(_same_plan(v.plan, validated[0].plan) for v in validated)
        return (f"{' and '.join(v.role for v in validated)} are {'the same plan, ' if same else ''}predicted "
                f"equal ({predictions[0] * 1e3:.1f} ms); measured {gap:.1%} apart, "
                f"{'inside' if gap < max(spreads) else 'outside'} the measured spread ({max(spreads):.1%})")
    if predicted == measured:
        return f"the measured order matches the predicted one ({' < '.join(measured)}; {gap:.1%} apart)"
    if gap < max(spreads):
        return (f"measured {' < '.join(measured)} against predicted {' < '.join(predicted)}, but {gap:.1%} apart "
                f"is inside the measured spread ({max(spreads):.1%}): a tie on this machine")
    return f"the measured order ({' < '.join(measured)}) contradicts the predicted one ({' < '.join(predicted)})"


def demo_markdown(result: object, validated: list[Validated], format_report: object) -> str:
    lines = ["# paratwin demo", "",
             f"Search: {result.considered:,} plans considered, {sum(result.pruned.values()):,} pruned, "
             f"{len(result.simulated)} simulated; best: `{result.best.candidate.describe()}`.", "",
             "| plan | role | predicted (ms) | measured median (ms) | error |", "| --- | --- | --- | --- | --- |"]
    for v in validated:
        lines.append(f"| {v.plan.name} | {v.role} | {v.report.predicted_s * 1e3:.1f} | "
                     f"{v.report.measured_s * 1e3:.1f} | {v.report.error:+.1%} |")
    lines += ["", f"Verdict: {_verdict(validated)}.", ""]
    for v in validated:
        report = "\n".join("##" + line if line.startswith("#") else line
                           for line in format_report(v.report).splitlines())
        lines += [f"## {v.role}: {v.plan.name}", "", report, ""]
    return "\n".join(lines)


def demo_html(result: object, validated: list[Validated], out: Path) -> str:
    def rel(path: Path) -> str:
        return html.escape(str(Path(path).resolve().relative_to(out.resolve())))

    rows = "".join(
        f"<tr><td>{html.escape(v.plan.name)}</td><td>{v.role}</td><td>{v.report.predicted_s * 1e3:.1f}</td>"
        f"<td>{v.report.measured_s * 1e3:.1f}</td><td>{v.report.error:+.1%}</td></tr>" for v in validated)
    sections = "".join(
        f"<h2>{v.role}: {html.escape(v.plan.name)}</h2>"
        f"<p><a href='{rel(v.report.paths['report_md'])}'>report</a> · "
        f"<a href='{rel(v.report.paths['combined_trace'])}'>predicted + measured trace</a> "
        f"(open in <a href='https://ui.perfetto.dev'>ui.perfetto.dev</a>)</p>"
        f"<img src='{rel(v.report.paths['timeline_png'])}' alt='predicted over measured timeline' width='100%'>"
        for v in validated)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>paratwin demo</title></head><body>"
            f"<h1>paratwin demo</h1><p>Search: {result.considered:,} plans considered, "
            f"{sum(result.pruned.values()):,} pruned, {len(result.simulated)} simulated; best: "
            f"<code>{html.escape(result.best.candidate.describe())}</code> "
            f"(<a href='search/best.yaml'>best.yaml</a>).</p>"
            f"<table border='1' cellpadding='4'><tr><th>plan</th><th>role</th><th>predicted ms</th>"
            f"<th>measured ms</th><th>error</th></tr>{rows}</table>"
            f"<p>Verdict: {html.escape(_verdict(validated))}.</p>{sections}</body></html>")
