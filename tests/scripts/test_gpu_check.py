"""scripts/gpu_check.sh without a GPU: its dry run (argument parsing, the environment probe, the
commands it would run, the output folder and the summary), its early failures, and the Python
helpers it calls (scripts/gpu_probe.py, scripts/gpu_summary.py) on synthetic inputs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NO_GPU_HERE = shutil.which("nvidia-smi") is None
TESTS_FILES = {"env.txt", "gpu_check.log", "build-tail.log", "junit-cuda.xml", "junit-stack.xml",
               "summary.md"}
BENCH_FILES = {"env.txt", "gpu_check.log", "build-tail.log", "bench.json", "summary.md"}


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe, summary = load("gpu_probe"), load("gpu_summary")


def run(tmp_path: Path, *args: str, path_prefix: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    # No wheels: as in CI, whatever a developer downloaded into .whl/ (for another Python).
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               GPU_CHECK_SCRATCH=str(tmp_path / "scratch"),
               GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_default_dry_run_is_the_correctness_call(tmp_path):
    done = run(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stdout
    out = done.stdout
    assert "setup.py build_ext --inplace" in out and "MAX_JOBS=" in out
    assert "TORCH_CUDA_ARCH_LIST=9.0" in out  # pinned: an image-wide list would multiply it
    assert "-m pytest" in out and "-m cuda tests/worker" in out
    assert "SHARDLM_TEST_DEVICE=cuda" in out and "tests/gateway/test_serve_cuda.py" in out
    assert "bench.run" not in out
    if NO_GPU_HERE:
        assert "a real run would stop here: no NVIDIA GPU visible" in out
    folder = tmp_path / "out"
    assert {p.name for p in folder.iterdir()} == TESTS_FILES
    assert summary.layout_problems(folder) == []
    page = (folder / "summary.md").read_text()
    assert "| junit-cuda.xml | 1 | 1 | 0 | 1 |" in page  # the synthetic failure is counted
    assert "test_dry_run_failure" in page and "| build | planned | 0 | 170 |" in page
    # The log holds the last line printed: it is written through a pipe the shell waits for.
    assert (folder / "gpu_check.log").read_text().splitlines()[-1].startswith("results in")
    assert not (tmp_path / "scratch" / "tree").exists()  # a dry run copies and builds nothing


def test_a_bench_call_benchmarks_one_shape(tmp_path):
    done = run(tmp_path, "--part", "bench", "--bench-shapes", "llama-3.2-1b", "--dry-run")
    assert done.returncode == 0, done.stdout
    assert "bench.run --device cuda --dtype bfloat16 --shapes llama-3.2-1b" in done.stdout
    assert "-m pytest" not in done.stdout
    folder = tmp_path / "out"
    assert {p.name for p in folder.iterdir()} == BENCH_FILES
    assert summary.layout_problems(folder) == []
    page = (folder / "summary.md").read_text()
    assert page.count("| 100.0 | 10.00 | 50.0 |") == 1
    assert [r["results"][0]["shape"] for r in json.loads((folder / "bench.json").read_text())
            ["runs"]] == ["llama-3.2-1b"]


@pytest.mark.parametrize("args", [["--part", "all"],
                                  ["--part", "bench", "--bench-shapes", "qwen2.5-0.5b,llama-3-8b"],
                                  ["--budget", "300"]])
def test_a_plan_over_the_budget_is_refused_before_anything_runs(tmp_path, args):
    done = run(tmp_path, *args, "--dry-run", timeout=30)
    assert done.returncode == 2
    assert "over the" in done.stderr and "each as a call of its own" in done.stderr
    assert not (tmp_path / "out").exists()


def test_every_call_fits_the_device_limit_by_construction():
    """The default budget leaves the call limit a margin, and each part's shares fit in it."""
    text = SCRIPT.read_text()
    limit = int(re.search(r"^CALL_LIMIT_S=(\d+)", text, re.M).group(1))
    budget = int(re.search(r"^DEFAULT_BUDGET=(\d+)", text, re.M).group(1))
    shares = {name: int(value) for name, value in re.findall(
        r"\[([A-Za-z ]+)\]=(\d+)", re.search(r"declare -A SHARE=\((.*?)\)", text, re.S).group(1))}
    assert limit == 600 and budget <= limit - 30
    common = shares["setup"] + shares["build"] + shares["summary"]
    assert common + shares["CUDA tests"] + shares["full stack on the GPU"] <= budget
    assert common + shares["bench"] <= budget


def test_all_runs_by_hand_without_limits(tmp_path):
    done = run(tmp_path, "--part", "all", "--budget", "0", "--bench-shapes",
               "qwen2.5-0.5b,llama-3-8b", "--dry-run")
    assert done.returncode == 0, done.stdout
    for shape in ("qwen2.5-0.5b", "llama-3-8b"):
        assert f"bench.run --device cuda --dtype bfloat16 --shapes {shape}" in done.stdout
    assert "-m cuda tests/worker" in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--part", "nope"], "--part must be tests, bench or all"),
    (["--budget", "soon"], "--budget must be a number of seconds"),
    (["--bench-shapes", "a b"], "--bench-shapes"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
])
def test_bad_arguments_exit_2_with_usage(tmp_path, args, message):
    done = run(tmp_path, *args, "--dry-run", timeout=30)
    assert done.returncode == 2
    assert message in done.stderr and "--part tests" in done.stderr  # the usage follows


@pytest.mark.skipif(not NO_GPU_HERE, reason="this machine has nvidia-smi")
def test_without_a_gpu_a_real_run_stops_at_once_with_a_clear_message(tmp_path):
    done = run(tmp_path, "--part", "tests", timeout=60)
    assert done.returncode == 3
    assert "GPU check stopped: no NVIDIA GPU visible" in done.stdout
    assert "problem: no NVIDIA GPU visible" in (tmp_path / "out" / "env.txt").read_text()
    assert not (tmp_path / "scratch" / "tree").exists()  # nothing was copied or built


def test_a_gpu_that_torch_cannot_use_stops_the_run(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB'\n")
    smi.chmod(0o755)
    done = run(tmp_path, "--part", "tests", path_prefix=str(fake), timeout=120)
    assert done.returncode == 3
    assert "GPU check stopped: torch" in done.stdout
    assert "has no CUDA support" in done.stdout or "sees no GPU" in done.stdout
    assert "gpu: NVIDIA H100 80GB HBM3" in (tmp_path / "out" / "env.txt").read_text()


# ----------------------------------------------------------------------------- gpu_probe.py


def test_the_wheel_list_parses_and_names_the_grpc_add_ons():
    names = {name for name, _version, _module in probe.wheel_list()}
    assert {"grpcio-status", "grpcio-health-checking", "grpcio-reflection",
            "googleapis-common-protos"} <= names


def test_every_listed_wheel_is_chosen_at_its_version(tmp_path, monkeypatch):
    listing = tmp_path / "wheels.txt"
    listing.write_text("# comment\nMarkup-Safe==3.0.2  json\nthere==1.0  json\n"
                       "absent==2.0  gone_b\n")
    monkeypatch.setattr(probe, "WHEEL_LIST", listing)
    for name in ("markup_safe-3.0.2-cp312-cp312-manylinux_2_17_x86_64.whl",
                 "markup_safe-3.0.1-py3-none-any.whl", "there-1.0-py3-none-any.whl"):
        (tmp_path / name).write_text("")
    chosen, lacking = probe.wheels_to_install(tmp_path)
    # Installed even where the module imports: the carried set is the one CI tests.
    assert [p.name for p in chosen] == ["markup_safe-3.0.2-cp312-cp312-manylinux_2_17_x86_64.whl",
                                        "there-1.0-py3-none-any.whl"]
    assert lacking == ["absent==2.0"]


def test_the_pins_meet_pyproject():
    wanted = probe.project_requirements()
    for name, version, _module in probe.wheel_list():
        requirement = wanted.get(probe.normalize(name))
        if requirement is not None:
            assert requirement.specifier.contains(version, prereleases=True), (name, version)


def test_every_project_dependency_is_accounted_for():
    """A runtime dependency the machine lacks and nobody carries would stop `shardlm serve`."""
    for requirement in probe.project_requirements().values():
        assert probe.normalize(requirement.name) in probe.known_distributions(), requirement.name


def test_unmet_requirements_say_what_is_needed_and_what_is_here(monkeypatch):
    here = {"grpcio": "1.62.0", "protobuf": "7.36.2"}
    monkeypatch.setattr(probe, "version_of", here.get)
    need = probe.Requirement
    assert probe.unmet(need("grpcio>=1.81.1"), {}) == \
        "grpcio>=1.81.1 is needed, grpcio 1.62.0 is here"
    assert probe.unmet(need("grpcio>=1.81.1"), {"grpcio": "1.85.3"}) is None  # carried beside it
    assert probe.unmet(need("protobuf<8,>=6.33.5"), {}) is None
    assert probe.unmet(need("gguf>=0.10"), {}) == "gguf>=0.10 is not installed"
    assert probe.unmet(need('pytest; extra == "test"'), {}) is None  # an extra's: not needed


def test_version_problems_name_a_carried_package_whose_needs_are_not_met(monkeypatch):
    here = {"smg-grpc-proto": "0.4.28", "grpcio": "1.62.0"}
    monkeypatch.setattr(probe, "version_of", lambda name: here.get(probe.normalize(name)))
    monkeypatch.setattr(probe, "requirements_of", lambda name: (
        [probe.Requirement("grpcio>=1.81.1")] if name == "smg-grpc-proto" else []))
    problems = probe.version_problems()
    assert "smg-grpc-proto 0.4.28: grpcio>=1.81.1 is needed, grpcio 1.62.0 is here" in problems
    assert "pyproject.toml: grpcio>=1.62 is needed, grpcio 1.62.0 is here" not in problems


def test_a_malformed_wheel_list_line_is_named(tmp_path):
    listing = tmp_path / "wheels.txt"
    listing.write_text("grpcio-status>=1.62\n")
    with pytest.raises(SystemExit, match="wheels.txt:1: expected `name==version module`"):
        probe.wheel_list(listing)


# ----------------------------------------------------------------------------- gpu_summary.py


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(summary.SYNTHETIC_JUNIT.replace(
        '<testcase classname="tests.worker.test_comm"',
        '<testcase classname="x" name="broken"><error message="boom\nmore"/></testcase>'
        '<testcase classname="tests.worker.test_comm"'))
    result = summary.read_junit(xml)
    assert (result["passed"], result["failed"], result["errors"], result["skipped"]) == (1, 1, 1, 1)
    assert ("j.xml: x::broken", "boom more") in result["failures"]
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite>")
    assert "unreadable" in summary.read_junit(tmp_path / "cut.xml")["note"]


def test_bench_rows_show_figures_errors_and_targets():
    bench = {"runs": [summary.synthetic_bench("tiny"),
                      {"results": [{"shape": "big", "engine": {"error": "OutOfMemoryError"}}],
                       "targets": [{"target": "t", "shape": "big", "value": None, "goal": 1,
                                    "pass": None}]}]}
    lines, targets = summary.bench_rows(bench)
    assert lines[0].startswith("| tiny | 100.0 | 10.00 | 50.0 | 700.0 (batch 8) | 5000 (512) |")
    assert "| 90.0 / 12.5 ms |" in lines[0]
    assert lines[1].startswith("| big | - |") and "engine: OutOfMemoryError" in lines[1]
    assert targets[-1] == "- not measured: t (big): -"


def test_bench_rows_name_what_an_interrupted_run_left_out():
    run = summary.synthetic_bench("tiny")
    for r in run["results"]:
        del r["stack"]
    lines, _ = summary.bench_rows({"runs": [dict(run, interrupted=True)]})
    assert "interrupted: stack not run" in lines[0]


def test_layout_problems_name_what_would_not_come_back(tmp_path):
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "x").write_text("x")
    (tmp_path / "bad name.txt").write_text("x")
    problems = summary.layout_problems(tmp_path)
    assert any("11 files, at most 8" in p for p in problems)
    assert any("more than 2 folders down" in p for p in problems)
    assert any("bad name.txt: names may hold only" in p for p in problems)
    ok = tmp_path / "ok"
    (ok / "prebuilt-0123abcd").mkdir(parents=True)
    (ok / "prebuilt-0123abcd" / "_C.cpython-312-x86_64-linux-gnu.so").write_text("x")
    assert summary.layout_problems(ok) == []


def test_the_built_library_is_small_enough_to_come_back():
    """setup.py builds without debug info: with it the CUDA build was about 17 MB, over the
    16 MiB a file may hold to come back from the device machine, so every call rebuilt it."""
    libraries = list((ROOT / "worker").glob("_C*.so"))
    if not libraries:
        pytest.skip("the ops are not built here")
    for library in libraries:
        assert library.stat().st_size < summary.MAX_FILE_BYTES, library.stat().st_size
