"""Benchmark outputs: a run writes a fresh run directory, only ``--publish`` replaces the published
files in benchmarks/results/, and every benchmark's command line explains itself."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess

import pytest

from benchmarks.outputs import REPO, RESULTS_DIR, add_output_args, machine_tag, open_run

BENCHMARKS = sorted(
    f[:-3] for f in os.listdir(os.path.join(REPO, "benchmarks")) if f.endswith(".py") and f not in ("__init__.py", "outputs.py")
)
# Benchmarks whose command lines are built by a ``build_parser()`` (the others build theirs in main).
PARSERS = tuple(m for m in BENCHMARKS if "def build_parser(" in open(os.path.join(REPO, "benchmarks", f"{m}.py")).read())


def test_a_run_writes_its_own_directory_and_publishes_only_when_asked(tmp_path):
    said: list[str] = []
    run = open_run("demo_bench", str(tmp_path / "run"), log=said.append)
    for suffix, text in ((".json", "{}"), (".md", "# t"), ("_plot.png", "png")):
        with open(run.path(suffix), "w") as f:
            f.write(text)
    run.path(".log")  # named, never written: not published
    results = tmp_path / "results"
    assert run.finish(False, "cpu9", results_dir=str(results)) == []
    assert not results.exists() and "untouched" in said[-1]
    published = run.finish(True, "cpu9", results_dir=str(results))
    assert sorted(os.path.basename(p) for p in published) == ["demo_bench_cpu9.json", "demo_bench_cpu9.md", "demo_bench_cpu9_plot.png"]
    assert (results / "demo_bench_cpu9.md").read_text() == "# t"
    assert sorted(os.listdir(tmp_path / "run")) == ["demo_bench.json", "demo_bench.md", "demo_bench_plot.png"]
    assert str(tmp_path / "run") in said[0]


def test_the_default_run_directory_is_fresh_under_logs_and_results_is_refused():
    a = open_run("test_bench_outputs_probe", log=lambda _: None)
    b = open_run("test_bench_outputs_probe", log=lambda _: None)
    try:
        assert a.run_dir != b.run_dir  # two runs in the same second still get their own
        assert os.path.dirname(a.run_dir) == os.path.join(REPO, "logs", "test_bench_outputs_probe")
    finally:
        shutil.rmtree(os.path.join(REPO, "logs", "test_bench_outputs_probe"))
    with pytest.raises(SystemExit, match="benchmarks/results"):
        open_run("x", os.path.join(RESULTS_DIR, "sub"), log=lambda _: None)
    assert re.fullmatch(r"cpu\d+", machine_tag())


@pytest.mark.parametrize("module", PARSERS)
def test_every_benchmark_option_has_help_and_the_output_options(module):
    parser: argparse.ArgumentParser = importlib.import_module(f"benchmarks.{module}").build_parser()
    parsers, opts = [parser], []
    while parsers:  # the parser and its subcommands' parsers
        for a in parsers.pop()._actions:
            if isinstance(a, argparse._SubParsersAction):
                parsers.extend(a.choices.values())
            elif a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction):
                opts.append(a)
    missing = [a.option_strings for a in opts if not (a.help or "").strip()]
    assert not missing, f"{module}: options without help: {missing}"
    names = {s for a in opts for s in a.option_strings}
    assert {"--run-dir", "--publish", "--machine"} <= names
    text = parser.format_help()
    assert not re.search(r"\bissue \d", text, re.I), f"{module} --help names a tracker issue"


def test_no_benchmark_speaks_of_tracker_issues_in_what_users_see():
    """Help, docstrings, printed lines and result files talk about the benchmark, not the tracker."""
    assert {"tq_throughput", "dataplane_scale"} <= set(PARSERS) and "tq_chaos" in BENCHMARKS
    for module in BENCHMARKS:
        src = open(os.path.join(REPO, "benchmarks", f"{module}.py")).read()
        assert not re.search(r"\bissue \d", src, re.I), module
    for name in os.listdir(RESULTS_DIR):
        if name.endswith(".md") and name.startswith(PARSERS):  # tq_chaos quotes the measured commit's subject
            assert not re.search(r"\bissue \d", open(os.path.join(RESULTS_DIR, name)).read(), re.I), name


def test_add_output_args_parses_publish_and_machine():
    p = argparse.ArgumentParser()
    add_output_args(p, "x")
    a = p.parse_args(["--publish", "--machine", "h100x4", "--run-dir", "/tmp/r"])
    assert (a.publish, a.machine, a.run_dir) == (True, "h100x4", "/tmp/r")
    assert p.parse_args([]).publish is False


def test_code_version_names_the_commit_and_whole_paths_of_uncommitted_tq_files():
    from benchmarks.outputs import code_version

    v = code_version()
    assert re.fullmatch(r"[0-9a-f]{7,}", v["commit"])
    assert all(p.startswith("tq/") for p in v["tq_uncommitted"]), v  # "XY path": no character of the path lost


def test_a_tree_exported_with_git_archive_still_names_its_commit(tmp_path):
    """A baseline tree carried to another machine as ``git archive`` output has no .git: its
    benchmarks/TREE_COMMIT, filled in by the export, names the commit (an empty name before)."""
    from benchmarks.outputs import REPO, archived_commit, code_version

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    assert not (tmp_path / ".git").exists()
    assert code_version(str(tmp_path)) == {"commit": head, "tq_uncommitted": []}
    assert archived_commit(REPO) == ""  # a checkout's own file holds the placeholder, never a stale name
