"""Inputs that used to give silent wrong results: a bundle used for a plan it does not describe,
edited or impossible bundle values, unchecked workload options, plans too large to simulate, plans
that do not fit, CPU plans without a profile, and examples that must simulate as shipped.

Real bundles (gpt-tiny profiled into a temporary folder), real files, no mocks.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sim.cluster import load_cluster
from sim.compile import MAX_INSTRUCTIONS, check_size, estimate_instructions
from sim.plan import Plan, migrate_flat
from sim.simulate import simulate
from traces.bundle import MANIFEST_NAME, _json_sha256, write_bundle
from traces.errors import BundleError, ConfigError, ParatwinError
from traces.schema import LAYER_TABLE
from traces.tables import _schema_stamp, _write_parquet, read_table

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted([*(REPO / "examples" / "plans").glob("*.yaml"), *(REPO / "examples" / "validation").glob("*.yaml")])


@pytest.fixture
def bundle_copy(gpt_tiny_profile: Path, tmp_path: Path) -> Path:
    """A copy of the session's gpt-tiny profile, for a test that changes it."""
    return Path(shutil.copytree(gpt_tiny_profile, tmp_path / "copy"))


def tiny_plan(profile: Path | None, **fields: object) -> Plan:
    base = {"name": "t", "workload": "gpt-tiny", "cluster": {"preset": "local-cpu-2"}, "pp": 2, "micro_batch": 1,
            "microbatches": 4, "profile": None if profile is None else str(profile)}
    return Plan.from_dict(migrate_flat({**base, **fields}))


def one_line(error: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def edit_manifest(bundle: Path, change) -> None:
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    change(manifest)
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))


def rewrite_layers(bundle: Path, change) -> None:
    """Rewrite layers.parquet and keep its checksum and row count consistent, as a careful hand edit."""
    path = bundle / "layers.parquet"
    layers = change(read_table(path, LAYER_TABLE))
    path.unlink()
    # As a hand edit would: straight to Parquet with the schema stamp (write_table refuses bad values).
    _write_parquet(layers, _schema_stamp(LAYER_TABLE), path)

    def fix(manifest: dict) -> None:
        manifest["sha256"]["layers.parquet"] = hashlib.sha256(path.read_bytes()).hexdigest()
        manifest["tables"]["layers"]["rows"] = len(layers)

    edit_manifest(bundle, fix)


# --- a bundle used for a plan it does not describe ---------------------------------------------------


def test_the_matching_plan_simulates(gpt_tiny_profile: Path) -> None:
    assert simulate(tiny_plan(gpt_tiny_profile)).iteration_s > 0


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ({"workload": "gpt2-medium"}, ("profile", "'gpt-tiny'", "'gpt2-medium'")),
        # the fix's command profiles the plan's options (it printed the preset's, whose bundle is refused)
        ({"workload_options": {"hidden": 128}}, ("workload.config.hidden", "hidden=64", "128", "(paratwin profile "
                                                 "--workload gpt-tiny --micro-batch 1 --workload-option hidden=128 "
                                                 "--dtype float32 --device cpu --out DIR)")),
        ({"workload_options": {"seq": 64}}, ("workload.config.seq", "seq=32", "64")),
        ({"workload_options": {"num_layers": 8}}, ("workload.config.num_layers",)),
        ({"dtype": "fp16"}, ("profile: dtype", "float32", "fp16")),
        ({"cluster": {"preset": "dgx-a100-8"}, "dp": 4}, ("profile: device", "gpu")),
    ],
)
def test_bundle_of_another_plan_is_refused(gpt_tiny_profile: Path, fields: dict, fragments: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as error:
        simulate(tiny_plan(gpt_tiny_profile, **fields))
    one_line(error, *fragments)


def test_a_bundle_written_before_a_config_field_existed_describes_its_old_value(bundle_copy: Path) -> None:
    # Bundles profiled before `attention` was a configuration field do not record it; they ran torch
    # SDPA (flash), so they describe flash plans and no others.
    def drop_attention(manifest: dict) -> None:
        del manifest["meta"]["workload"]["config"]["attention"]
        manifest["extra_sha256"]["meta"] = _json_sha256(manifest["meta"])

    edit_manifest(bundle_copy, drop_attention)
    assert simulate(tiny_plan(bundle_copy)).iteration_s > 0
    with pytest.raises(ConfigError) as error:
        simulate(tiny_plan(bundle_copy, workload_options={"attention": "unfused"}))
    one_line(error, "workload.config.attention", "attention='flash'", "'unfused'")


@pytest.mark.parametrize("where", ["missing", "empty folder", "a file"])
def test_a_profile_that_names_no_bundle_is_refused_on_its_field(tmp_path: Path, where: str) -> None:
    """A profiled plan whose bundle is not there (moved, misspelt, a plan file passed by mistake) names
    the plan's ``profile`` field and the command that writes a bundle, not only the path."""
    target = tmp_path / "bundle"
    if where == "empty folder":
        target.mkdir()
    elif where == "a file":
        target.write_text("name: t\n")
    with pytest.raises(ConfigError) as error:
        simulate(tiny_plan(target, workload_options={"grad_accumulation": "autograd"}))
    assert error.value.field == "profile"
    # grad_accumulation changes no time a profile measures (UNPROFILED_OPTIONS): the command leaves it out
    message = one_line(error, str(target), "paratwin profile --workload gpt-tiny --micro-batch 1 --dtype float32 "
                       "--device cpu --out DIR")
    assert "grad_accumulation" not in message


def test_bundle_with_a_layer_row_missing_is_refused(bundle_copy: Path) -> None:
    rewrite_layers(bundle_copy, lambda t: t[t["layer"] != 2].reset_index(drop=True))
    with pytest.raises(BundleError) as error:
        simulate(tiny_plan(bundle_copy))
    one_line(error, "layers.parquet", "[2] missing")


def test_edited_manifest_meta_is_refused(bundle_copy: Path) -> None:
    # micro_batch 1 -> 9 divides every predicted time by 9 if it is believed.
    edit_manifest(bundle_copy, lambda m: m["meta"]["settings"].update(micro_batch=9))
    with pytest.raises(BundleError) as error:
        simulate(tiny_plan(bundle_copy))
    one_line(error, MANIFEST_NAME, "'meta' differs from its checksum")


def test_deleted_sha256_entry_is_refused(bundle_copy: Path) -> None:
    edit_manifest(bundle_copy, lambda m: m["sha256"].pop("layers.parquet"))
    with pytest.raises(BundleError) as error:
        simulate(tiny_plan(bundle_copy))
    one_line(error, MANIFEST_NAME, "no sha256 entry for table 'layers'")


@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf")])
def test_negative_or_nan_time_is_refused_on_load(bundle_copy: Path, value: float) -> None:
    def poison(table: pd.DataFrame) -> pd.DataFrame:
        table.loc[3, "bwd_input_s"] = value
        return table

    rewrite_layers(bundle_copy, poison)
    with pytest.raises(BundleError) as error:
        simulate(tiny_plan(bundle_copy))
    one_line(error, "layers.parquet", "table 'layers' row 3 column 'bwd_input_s'", "finite and >= 0")


# --- plan files and workload options ------------------------------------------------------------------


def test_non_utf8_plan_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\nworkload: gpt-tiny\n".encode("latin-1"))
    with pytest.raises(ConfigError) as error:
        Plan.load(path)
    one_line(error, "latin1.yaml", "not UTF-8")


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"seq": -5}, ("workload_options.seq", "-5")),
        ({"seq": 0}, ("workload_options.seq",)),
        ({"seq": "abc"}, ("workload_options.seq", "'abc'")),
        ({"seq": True}, ("workload_options.seq",)),
        ({"hidden": 2.5}, ("workload_options.hidden",)),
        ({"heads": 3}, ("workload_options.heads", "do not divide")),
        ({"family": "bert"}, ("workload_options", "family")),
        ({"layers": 4}, ("workload_options", "unknown option(s) ['layers']", "num_layers", "seq")),
    ],
)
def test_workload_options_are_checked(gpt_tiny_profile: Path, options: dict, fragments: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as error:
        simulate(tiny_plan(gpt_tiny_profile, workload_options=options))
    one_line(error, *fragments)


@pytest.mark.parametrize("value", ["blocked", "Blocking", True])
def test_a_misspelt_p2p_names_the_values_in_its_fix(value: object) -> None:
    """schedule.p2p takes one of fixed words: the fix says which, not only what was written."""
    with pytest.raises(ConfigError) as error:
        Plan.from_dict({"workload": "gpt-tiny", "parallelism": {"pp": 2}, "schedule": {"p2p": value}})
    one_line(error, "schedule.p2p", f"(fix: write 'async' or 'blocking', not {value!r})")


@pytest.mark.parametrize("value", ["maybe", 3, [True]])
def test_a_switch_that_is_not_a_boolean_names_true_and_false_in_its_fix(value: object) -> None:
    """schedule.p2p_scatter_gather is true or false: the fix says so (it said only "got 'maybe'")."""
    with pytest.raises(ConfigError) as error:
        Plan.from_dict({"workload": "gpt-tiny", "parallelism": {"pp": 2}, "schedule": {"p2p_scatter_gather": value}})
    one_line(error, "schedule.p2p_scatter_gather", f"(fix: write true or false, not {value!r})")


@pytest.mark.parametrize(("section", "field", "value", "fix"), [
    ("parallelism", "dp", True, "(fix: write a whole number, not True)"),  # read as dp 1 before
    ("schedule", "micro_batch", False, "(fix: write a whole number, not False)"),  # read as 0, then "< 1"
    ("parallelism", "tp", "two", "(fix: write a whole number, not 'two')"),  # the fix read "got 'two'"
    ("parallelism", "pp", 2.5, "(fix: write a whole number, not 2.5)"),
    ("schedule", "microbatches", 0, "(fix: write a number >= 1, not 0)"),
    ("parallelism", "tp_overlap", 5, "(fix: write a number <= 3, not 5)"),
])
def test_a_count_names_a_whole_number_in_its_fix(section: str, field: str, value: object, fix: str) -> None:
    """A degree or a micro-batch count is a whole number in range: true/false is refused, not read as 1 or 0,
    and the fix says what to write (it said only what was written)."""
    with pytest.raises(ConfigError) as error:
        Plan.from_dict({"workload": "gpt-tiny", section: {field: value}})
    one_line(error, f"{section}.{field}", fix)


@pytest.mark.parametrize(("parallelism", "value", "fix"), [
    ({"pp": 2}, 0.5, "(fix: write a list, one value per virtual stage (pp x chunks = 2 here), each the fraction "
                     "of kept bytes swapped to host: swap: [0.5, 0.5])"),
    ({"pp": 2, "chunks": 2}, 1, "(pp x chunks = 4 here), each the fraction of kept bytes swapped to host: "
                                "swap: [1, 1, 1, 1])"),
    ({"pp": 2}, "half", "each the fraction of kept bytes swapped to host; not 'half')"),
])
def test_a_per_stage_list_given_one_value_says_what_to_write(parallelism: dict, value: object, fix: str) -> None:
    """memory.swap is one fraction per virtual stage: given one number, the fix said only "got 0.5"."""
    with pytest.raises(ConfigError) as error:
        Plan.from_dict({"workload": "gpt-tiny", "parallelism": parallelism,
                        "memory": {"policy": "none", "swap": value}})
    one_line(error, "memory.swap: Input should be a valid list", fix)


@pytest.mark.parametrize(("fields", "where"), [
    ({"cluster": 64}, "plan: cluster: Input should be a valid string"),  # read "cluster.str"
    ({"parallelism": {"partition": "balanced"}}, "plan: parallelism.partition: Input should be 'uniform'"),
])
def test_a_union_fields_error_names_the_field_not_the_member(fields: dict, where: str) -> None:
    """A field that takes one of several types named the member that failed after it: "cluster.str",
    "parallelism.partition.literal['uniform','parameters','time']"."""
    with pytest.raises(ConfigError) as error:
        Plan.from_dict({"workload": "gpt-tiny", **fields})
    one_line(error, where)


@pytest.mark.parametrize(("section", "key"), [("memory", "policy"), ("gradient_sync", "method"),
                                              ("embedding", "method")])
def test_a_section_without_its_choice_says_so(section: str, key: str) -> None:
    """It read "policy None is not a registered memory policy"."""
    with pytest.raises(ConfigError) as error:
        Plan.from_dict({"workload": "gpt-tiny", section: {"ratio": 0.5}})
    one_line(error, section, f"no {key} named")
    assert "None" not in str(error.value) and "registered: " in str(error.value)


@pytest.mark.parametrize(("section", "choice", "fix"), [
    ("memory", "full", "write memory: {policy: full}"),
    ("gradient_sync", "powersgd", "write gradient_sync: {method: powersgd}"),
    ("embedding", "embrace", "write embedding: {method: embrace}")])
def test_a_choice_written_without_its_section_gets_the_section_in_its_fix(section: str, choice: str, fix: str) -> None:
    """``memory: full`` read "Input should be a valid dictionary ... (fix: got 'full')"."""
    with pytest.raises(ConfigError) as error:
        Plan.from_dict({"workload": "gpt-tiny", section: choice})
    one_line(error, section, fix)


def test_lstm_options_are_checked() -> None:
    with pytest.raises(ConfigError) as error:
        simulate(Plan(workload="lstm-tiny", cluster="local-cpu-2", parallelism={"dp": 2},
                      workload_options={"hidden": -1}))
    one_line(error, "workload_options.hidden")


# --- sizes that cannot be simulated ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ({"microbatches": 10**12}, ("microbatches", "limit of 500,000")),
        ({"pp": 4, "chunks": 1, "microbatches": MAX_INSTRUCTIONS}, ("microbatches",)),
    ],
)
def test_plans_too_large_are_refused_up_front(fields: dict, fragments: tuple[str, ...]) -> None:
    plan = Plan.from_dict(migrate_flat({"workload": "gpt2-medium", "cluster": {"preset": "dgx-a100-8"},
                                        "dtype": "fp16", "dp": 2, "pp": 4, **fields}))
    with pytest.raises(ConfigError) as error:
        simulate(plan)  # refused before lowering: no MemoryError, no minutes
    one_line(error, *fragments)


def test_full_simulation_counts_every_rank() -> None:
    plan = Plan.load(REPO / "examples" / "plans" / "gpt-175b-h100-1024.yaml")
    assert estimate_instructions(plan, full=True) == estimate_instructions(plan, full=False) * plan.dp * plan.tp
    check_size(plan, full=False)
    big = plan.replace(schedule={"microbatches": MAX_INSTRUCTIONS // (10 * plan.pp) + 1})
    with pytest.raises(ConfigError) as error:
        check_size(big, full=True)
    one_line(error, "dp x tp x pp", "drop --full")


def test_run_refuses_more_ranks_than_one_host_can_start() -> None:
    from sim.compile import check_local_run

    plan = Plan.from_dict({"workload": "gpt-tiny", "cluster": {"preset": "local-cpu-2", "devices_per_node": 4096},
                           "parallelism": {"dp": 4096}})
    with pytest.raises(ConfigError) as error:
        check_local_run(plan)
    one_line(error, "dp x tp x pp", "4096 ranks on one machine")


# --- a plan that does not fit ---------------------------------------------------------------------------


def test_plan_that_does_not_fit_exits_3_and_keeps_its_outputs(tmp_path: Path) -> None:
    # GPT-175B with TP 8 alone on one DGX A100: ~350 GB of model states per GPU of 80 GB.
    plan = {"name": "too-big", "workload": "gpt-175b", "cluster": "dgx-a100-8", "dtype": "fp16",
            "parallelism": {"tp": 8}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "simulate", str(tmp_path / "p.yaml"), "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, done.stdout
    assert "does not fit: rank 0" in lines[0] and "bytes" in lines[0] and "first over capacity at" in lines[0]
    assert "Traceback" not in done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["oom"] is True and (out / "instructions.parquet").is_file()


def test_a_plan_that_fits_has_no_does_not_fit(gpt_tiny_profile: Path) -> None:
    assert simulate(tiny_plan(gpt_tiny_profile)).does_not_fit() is None


def test_ranks_on_one_host_share_its_memory(gpt_tiny_profile: Path) -> None:
    cluster = load_cluster("local-cpu-2")
    assert cluster.memory_per_rank_bytes == int(cluster.device.memory_bytes) // 2
    result = simulate(tiny_plan(gpt_tiny_profile))
    assert {m.capacity_bytes for m in result.memory.values()} == {cluster.memory_per_rank_bytes}
    assert load_cluster("dgx-a100-8").memory_per_rank_bytes == int(load_cluster("dgx-a100-8").device.memory_bytes)


# --- CPU plans without a profile --------------------------------------------------------------------------


def test_cpu_plan_without_profile_is_refused_not_guessed() -> None:
    with pytest.raises(ConfigError) as error:
        simulate(tiny_plan(None))
    one_line(error, "profile", "analytic model does not predict CPU times", "paratwin profile --workload gpt-tiny")


# --- every example simulates ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"root": tmp_path_factory.mktemp("example-profiles")}


def _profile_for(plan: Plan, profiles: dict[str, Path]) -> Path:
    """A CPU plan needs a profile of its own workload (the documented policy): measure it once."""
    from exec.profiler import profile_workload
    from exec.workloads import get_workload

    key = json.dumps([plan.workload, plan.workload_options, plan.micro_batch], sort_keys=True)
    if key not in profiles:
        bundle = profile_workload(get_workload(plan.workload, **plan.workload_options), micro_batch=plan.micro_batch,
                                  warmup=0, repeats=1, with_ops=False, device="cpu")
        profiles[key] = write_bundle(bundle, profiles["root"] / hashlib.sha1(key.encode()).hexdigest()[:12])
    return profiles[key]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_simulates(path: Path, profiles: dict[str, Path]) -> None:
    plan = Plan.load(path)
    if load_cluster(plan.cluster).device.kind == "cpu" and plan.profile is None:
        with pytest.raises(ConfigError, match="profile"):
            simulate(plan)
        plan = plan.replace(profile=str(_profile_for(plan, profiles)))
    try:
        result = simulate(plan)
    except ParatwinError as exc:
        pytest.fail(f"{path.name}: {exc}")
    assert result.iteration_s > 0 and not result.oom


def test_demo_what_if_is_the_readme_example_plan() -> None:
    from analysis.demo import WHAT_IF_PLAN

    assert WHAT_IF_PLAN == REPO / "examples" / "plans" / "gpt-8.3b-a100-64-merak.yaml"
    assert Plan.load(WHAT_IF_PLAN).parallelism.tp_overlap == 3
