"""A user's own model, named by import path (``workload: mymodels.mlp:MyMLP``), from a folder outside the
package: profiled, simulated and run by the command line as a user runs it, the simulated and the run
instruction tables joined, and every refusal one line with its fix (docs/profiler.md, "Your own model")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from exec.workloads import get_workload
from sim.plan import Plan
from sim.simulate import simulate
from tests.demo_output import instructions
from traces.errors import ConfigError
from traces.runrecord import read_run_record

REPO = Path(__file__).resolve().parents[1]
MODULE = "mymodels.mlp"

MLP = textwrap.dedent('''
    import torch
    from torch import nn

    from exec.workloads import Batch, Workload


    class MyMLP(Workload):
        name = "my-mlp"

        def __init__(self, width: int = 64, depth: int = 4, n_in: int = 32, n_cls: int = 10) -> None:
            self.width, self.depth, self.n_in, self.n_cls = width, depth, n_in, n_cls

        def layer_names(self) -> list[str]:
            return ["inp"] + [f"fc{i}" for i in range(self.depth)] + ["head"]

        def build_layer(self, index: int) -> nn.Module:
            if index == 0:
                return nn.Linear(self.n_in, self.width)
            if index == self.num_layers - 1:
                return nn.Linear(self.width, self.n_cls)
            return nn.Sequential(nn.Linear(self.width, self.width), nn.ReLU())

        def make_batch(self, micro_batch: int, seed: int = 0, device="cpu") -> Batch:
            g = torch.Generator().manual_seed(seed)
            return Batch(torch.randn(micro_batch, self.n_in, generator=g).to(device),
                         torch.randint(0, self.n_cls, (micro_batch,), generator=g).to(device))

        def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(output, targets)


    def make_mlp(width: int = 64) -> MyMLP:
        return MyMLP(width=width, depth=2)


    class NotAWorkload:
        pass


    def make_nothing():
        return None
''')

PLAN = textwrap.dedent('''
    name: my-mlp-pp2
    workload: mymodels.mlp:MyMLP
    cluster: local-cpu-2
    parallelism: {pp: 2}
    schedule: {name: 1f1b, micro_batch: 4, microbatches: 4}
    profile: prof
''')


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A user's folder: the model's package, a plan naming it, and (its profile) prof/, written by
    ``paratwin profile`` run there as an installed script runs: the folder is the current directory and
    not on sys.path (the script's own folder is), the package found by paratwin's fallback to the
    current directory."""
    root = tmp_path_factory.mktemp("user")
    (root / "mymodels").mkdir()
    (root / "mymodels" / "__init__.py").write_text("")
    (root / "mymodels" / "mlp.py").write_text(MLP)
    (root / "mymodels" / "broken.py").write_text("import a_dependency_not_installed_anywhere\n")
    (root / "plan.yaml").write_text(PLAN)
    done = paratwin(root, "profile", "--workload", "mymodels.mlp:MyMLP", "--micro-batch", "4", "--device", "cpu",
                    "--repeats", "2", "--warmup", "1", "--no-ops", "--out", "prof")
    assert done.returncode == 0, done.stdout + done.stderr
    yield root
    # What the in-process tests below imported, and the folder the workload's import added to sys.path.
    for name in [m for m in sys.modules if m == "mymodels" or m.startswith("mymodels.")]:
        del sys.modules[name]
    sys.path[:] = [entry for entry in sys.path if entry != str(root)]


def paratwin(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``paratwin ARGS`` in ``cwd``, started as the installed ``paratwin`` script starts it (a script in another
    folder: sys.path holds that folder and PYTHONPATH, not the current directory)."""
    entry = cwd.parent / f"{cwd.name}-bin" / "paratwin.py"
    entry.parent.mkdir(exist_ok=True)
    entry.write_text("import sys\n\nfrom analysis.cli import main\n\n"
                     "if __name__ == '__main__':\n    sys.exit(main())\n")  # as pip writes the script
    return subprocess.run([sys.executable, str(entry), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_profile_simulate_and_run_a_workload_named_by_import_path(folder: Path) -> None:
    """The bundle records the import path; the pp 2 plan naming it simulates and runs on 2 gloo ranks, and
    every measured iteration ran exactly the simulated instructions (both interpret one Program)."""
    meta = pd.read_json(folder / "prof" / "manifest.json", typ="series")["meta"]
    assert meta["workload"]["name"] == "mymodels.mlp:MyMLP" and meta["workload"]["config"] == {}
    done = paratwin(folder, "simulate", "plan.yaml", "--out", "sim")
    assert done.returncode == 0, done.stdout + done.stderr
    done = paratwin(folder, "run", "plan.yaml", "--out", "run", "--iterations", "2", "--warmup", "1",
                    "--backend", "gloo")
    assert done.returncode == 0, done.stdout + done.stderr
    predicted = instructions(pd.read_parquet(folder / "sim" / "instructions.parquet"))
    assert {row[2] for row in predicted} >= {"FWD", "SEND_ACT", "RECV_ACT", "OPTIMIZER_STEP"}, predicted
    measured = read_run_record(folder / "run" / "record").instructions
    assert sorted(measured["iteration"].unique()) == [1, 2]
    for iteration, rows in measured.groupby("iteration"):
        assert instructions(rows) == predicted, f"iteration {iteration} ran other instructions"
    listed = paratwin(folder, "workloads")
    assert "import path, module:Class" in listed.stdout, listed.stdout


def test_rank_processes_import_the_module_from_the_launchers_path(folder: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's folder is on this process's sys.path only, added after the forkserver the ranks fork from
    has started (with the sys.path of then, in another current directory): each rank starts with the
    launcher's sys.path at launch (multiprocessing hands it over), so it imports the module too."""
    from exec.launcher import run_plan
    from traces.forkserver import forkserver_context

    started = forkserver_context().Process(target=time.sleep, args=(0,))
    started.start()
    started.join()
    monkeypatch.syspath_prepend(str(folder))
    plan = Plan.from_dict({"name": "my-mlp-dp2", "workload": "mymodels.mlp:make_mlp",
                           "workload_options": {"width": 16}, "parallelism": {"dp": 2},
                           "schedule": {"micro_batch": 2, "microbatches": 2}})
    result = run_plan(plan, iterations=1, warmup=0, backend="gloo", out_dir=folder / "run-dp2")
    assert len(result.losses) == 1 and result.losses[0] > 0


def test_a_bundle_describes_its_own_workload_and_options_only(folder: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A factory's options are recorded in its bundle; a plan of another workload, or of this one with other
    options (or none), is refused with the field at fault; the plan that matches it simulates."""
    from exec.profiler import Steadiness, profile_workload
    from traces.bundle import write_bundle

    monkeypatch.syspath_prepend(str(folder))
    bundle = profile_workload(get_workload("mymodels.mlp:make_mlp", width=16), micro_batch=4, device="cpu",
                              warmup=0, repeats=1, with_ops=False, steady=Steadiness.fixed())
    path = write_bundle(bundle, tmp_path / "prof")
    assert bundle.meta["workload"]["config"] == {"width": 16}

    def plan(workload: str, **options: object) -> Plan:
        return Plan.from_dict({"workload": workload, "workload_options": options, "profile": str(path),
                               "parallelism": {"pp": 2}, "schedule": {"micro_batch": 4, "microbatches": 2}})

    assert simulate(plan("mymodels.mlp:make_mlp", width=16)).iteration_s > 0
    for refused, fragments in [
        (plan("mymodels.mlp:MyMLP"), ("profile:", "profiles workload 'mymodels.mlp:make_mlp'", "the plan's workload is "
                                      "'mymodels.mlp:MyMLP'")),
        (plan("mymodels.mlp:make_mlp"), ("profile: workload.config.width:", "profiled with width=16, the plan does not "
                                         "set it")),
        (plan("mymodels.mlp:make_mlp", width=32), ("profiled with width=16, the plan has 32",)),
    ]:
        with pytest.raises(ConfigError) as error:
            simulate(refused)
        one_line(error, *fragments, "paratwin profile --workload")


def test_simulating_without_a_profile_or_with_tp_is_refused(folder: Path) -> None:
    """No closed-form costs: the fix is the profile command for this workload; and no tensor parallelism,
    which the Workload interface has no way to declare."""
    base = Plan.load(folder / "plan.yaml")
    with pytest.raises(ConfigError) as error:
        simulate(base.replace(profile=None))
    one_line(error, "profile: workload 'mymodels.mlp:MyMLP' has no closed-form cost model",
             "paratwin profile --workload mymodels.mlp:MyMLP --micro-batch 4 --dtype float32 --device cpu --out DIR")
    tp = Plan.from_dict({**base.model_dump(), "parallelism": {"tp": 2}, "profile": str(folder / "prof")})
    with pytest.raises(ConfigError) as error:
        simulate(tp)
    one_line(error, "parallelism.tp: tensor parallelism is defined for transformer workloads, not "
             "mymodels.mlp:MyMLP", "set tp: 1 (a workload named by import path runs data- and pipeline-parallel")


@pytest.mark.parametrize(("name", "options", "fragments"), [
    ("nosuch_user_pkg.mlp:MyMLP", {}, ("workload: no module 'nosuch_user_pkg'", "the current directory",
                                       "PYTHONPATH", "every rank process imports it too")),
    ("mymodels.nosuch:MyMLP", {}, ("package mymodels (", "has no module 'nosuch'")),
    ("mymodels.broken:X", {}, ("importing mymodels.broken failed", "a_dependency_not_installed_anywhere")),
    ("mymodels.mlp:Nope", {}, ("mlp.py) has no attribute 'Nope'", "Workload subclasses there: MyMLP")),
    ("mymodels.mlp:NotAWorkload", {}, ("is a class (NotAWorkload), not a Workload subclass or a factory",)),
    ("mymodels.mlp:make_nothing", {}, ("make_nothing() returned a NoneType, not a Workload",)),
    ("mymodels.mlp:MyMLP", {"bogus": 1}, ("workload_options: mymodels.mlp:MyMLP(bogus=1) failed",
                                          "unexpected keyword argument 'bogus'")),
    ("mymodels/mlp.py", {}, ("unknown workload 'mymodels/mlp.py'", "name your own Workload by import path")),
])
def test_a_workload_that_cannot_be_built_is_one_line(folder: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                     options: dict, fragments: tuple[str, ...]) -> None:
    monkeypatch.chdir(folder)  # found from the current directory, as the command line finds it
    with pytest.raises(ConfigError) as error:
        get_workload(name, **options)
    one_line(error, *fragments)


def test_the_command_line_names_the_path_searched_without_a_traceback(folder: Path) -> None:
    done = paratwin(folder, "profile", "--workload", "nosuch_user_pkg.mlp:MyMLP", "--out", "x")
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: workload: no module 'nosuch_user_pkg'"), done.stdout
    assert f"the current directory {folder}" in lines[0] and f"PYTHONPATH {REPO}" in lines[0], lines[0]
    assert not (folder / "x").exists()


def one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
