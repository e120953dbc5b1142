"""Faults in real processes: `diag` killed (SIGKILL), interrupted (SIGINT) or out of space (file-size limit)
at a write point of each driver, then resumed; the resumed store must equal an uninterrupted run exactly.
Also: a second concurrent writer is refused, and a re-run on changed inputs is refused.

Each `diag` run is a real child process, forked from one helper process that imported torch, transformers
and the toolkit once (a fresh interpreter per run would spend most of this file's time importing). The
write point is picked with $SUBMERGE_FAULT_AT (see `submerge.diagnostics.faults.fault_point`); the number of write
points of each driver is counted from the reference run's $SUBMERGE_WRITE_LOG.

The full matrix (every write point × kill / interrupt / no space × linearity, alpha, interference, evidence) runs
with SUBMERGE_FAULT_MATRIX=1; by default a few points spread over each driver's writes run. The evidence group is
written by `diag compare` (its plan's evidence step) before the group ``compare``: its write points are the writes
into ``evidence/``, and a run faulted at one of them must resume to the uninterrupted run's evidence.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from submerge.diagnostics import toy
from submerge.diagnostics.store import Store

ROOT = Path(__file__).resolve().parents[1]

SERVER = textwrap.dedent("""
    import json, os, resource, signal, sys
    import torch
    torch.set_num_threads(1)
    import transformers, transformers.modeling_utils
    from transformers.models.llama import modeling_llama
    import submerge.diagnostics.experiment, submerge.diagnostics.linearity, submerge.diagnostics.interference, submerge.diagnostics.store
    from submerge.cli.main import app

    def reap(pid, reader, log):
        with os.fdopen(reader, "rb") as output, open(log, "wb") as handle:
            handle.write(output.read())
        return {"rc": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            print(json.dumps(reap(request["wait"], request["fd"], request["log"])), flush=True)
            continue
        reader, writer = os.pipe()  # output goes through a pipe: a file-size limit must not hit the log
        pid = os.fork()
        if pid == 0:
            os.close(reader)
            os.dup2(writer, 1)
            os.dup2(writer, 2)
            os.environ.update(request["env"])
            # Ctrl-C raises KeyboardInterrupt as at a terminal, also when this test run was started as a
            # background job (which inherits SIGINT ignored, and then Python installs no handler)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if request.get("fsize") is not None:
                hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
                resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], hard))
            app(request["argv"], prog_name="diag")  # exits (SystemExit) through the normal interpreter exit
        os.close(writer)
        if request.get("background"):
            print(json.dumps({"pid": pid, "fd": reader}), flush=True)
        else:
            print(json.dumps(reap(pid, reader, request["log"])), flush=True)
""")


class Diag:
    """Runs `diag ARGS` in a forked child of a warm helper; returns (exit code, output)."""

    def __init__(self, tmp: Path):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        for name in ("SUBMERGE_FAULT_AT", "SUBMERGE_WRITE_LOG"):
            env.pop(name, None)
        self.tmp, self.runs = tmp, 0
        self.server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=env, cwd=tmp)
        assert self.server.stdout.readline().strip() == "ready"

    def _ask(self, request: dict) -> dict:
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        return json.loads(self.server.stdout.readline())

    def __call__(self, *argv: str, env: dict | None = None, fsize: int | None = None,
                 background: bool = False) -> tuple[int, str] | dict:
        """Exit code and output; with `background`, {"pid", "fd", "log"} to pass to `wait` later."""
        self.runs += 1
        log = self.tmp / f"run{self.runs}.log"
        request = {"argv": [str(a) for a in argv], "env": {"COLUMNS": "1000", **(env or {})}, "fsize": fsize,
                   "log": str(log), "background": background}
        reply = self._ask(request)
        if background:
            return {**reply, "log": str(log)}
        return reply["rc"], log.read_text()

    def wait(self, child: dict) -> tuple[int, str]:
        reply = self._ask({"wait": child["pid"], "fd": child["fd"], "log": child["log"]})
        return reply["rc"], Path(child["log"]).read_text()

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)


def _built_once(tmp_path_factory, name: str, build) -> dict:
    """`build(folder)`'s result (a JSON-able dict), built once per test run into a folder every xdist worker shares
    and read back by the others. Module or session fixtures were not enough: a worker runs this module's tests
    between other modules' and tears its fixtures down whenever its queue runs dry, and the references were built
    again each time (2 to 4 times a suite, ~40 s each)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    result = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not result.exists():  # a new folder for each try: one that failed half-way is not built upon
            folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=shared))
            result.write_text(json.dumps(build(folder), default=str))
    return json.loads(result.read_text())


@pytest.fixture(scope="session")
def kit(tmp_path_factory):
    def build(root: Path) -> dict:
        base = toy.build_model(root / "base", "llama", layers=2, hidden=32)
        tuned = toy.perturbed_finetunes(base, ["math", "code"])
        data = {task: toy.write_task_data(root / f"{task}.jsonl", task, count=6) for task in ("math", "code")}
        return {"base": base, "tuned": tuned, "data": data, "root": root}

    built = _built_once(tmp_path_factory, "fault_kit", build)
    return {"base": Path(built["base"]), "tuned": {t: Path(p) for t, p in built["tuned"].items()},
            "data": {t: Path(p) for t, p in built["data"].items()}, "root": Path(built["root"])}


@pytest.fixture(scope="session")
def diag(tmp_path_factory):
    runner = Diag(tmp_path_factory.mktemp("fault_runs"))
    yield runner
    runner.close()


def _inputs(kit, swap: bool = False, data: dict | None = None) -> list[str]:
    tuned = kit["tuned"]
    first, second = (tuned["code"], tuned["math"]) if swap else (tuned["math"], tuned["code"])
    data = data or kit["data"]
    return ["--model", kit["base"], "-f", f"math={first}", "-f", f"code={second}",
            "--data", f"math={data['math']}", "--data", f"code={data['code']}"]


COMMON = ["--no-progress", "--device", "cpu"]
DRIVERS = {
    "linearity": ("linearity", lambda kit: ["linearity", *_inputs(kit), "--samples", "4", "--max-tokens", "32",
                                            "--steps", "3", *COMMON]),
    "alpha": ("alpha/layer", lambda kit: ["alpha", *_inputs(kit), "--samples", "4", "--max-tokens", "32", *COMMON]),
    "interference": ("interference", lambda kit: ["interference", "--model", kit["base"],
                                                  "-f", f"math={kit['tuned']['math']}",
                                                  "-f", f"code={kit['tuned']['code']}", "--rank-fracs", "0.25,1",
                                                  *COMMON]),
    "evidence": ("evidence", lambda kit: ["compare", *_inputs(kit), "--methods", "plan", "--fit", "4", "--samples", "2",
                                          "--folds", "2", "--candidates", "layer,attn-mlp,head-mlp", "--max-tokens",
                                          "32", *COMMON]),
    "projection": ("projection", lambda kit: ["projection", *_inputs(kit), "--samples", "4", "--max-tokens", "32",
                                              "--levels", "model,layer,attn", "--alpha", "0,0.5,1", *COMMON]),
    "eval": ("eval", lambda kit: ["eval", *_inputs(kit), "--skip", "2", "--samples", "2", "--max-tokens", "32",
                                  "--merged", f"mean={kit['tuned']['math']}", *COMMON]),
    # the merges compare evaluates are written (merge write points: shards, record, copied files) into its scratch
    # folder, outside the store: a fault there must leave nothing behind that the resumed run trips over
    "compare": ("compare", lambda kit: ["compare", *_inputs(kit), "--methods", "task-arithmetic,ties", "--fit", "2",
                                        "--samples", "2", "--max-tokens", "32", *COMMON]),
}


SHARED = {"evidence"}  # drivers whose command writes other groups too: their write points are those into the group


def _group_of(path: str, store: Path) -> str | None:
    """The top-level group a written file belongs to (None: the store's root or a file outside the store)."""
    if not Path(path).is_relative_to(store):
        return None
    parts = Path(path).relative_to(store).parts
    return parts[0] if len(parts) > 1 else None


TIMINGS = {"compare": {"seconds"}}  # wall-clock variables: measured again by a resumed run, never equal


def _assert_same_store(path: Path, reference: Path, group: str) -> None:
    written, expected = Store(path).dataset(group), Store(reference).dataset(group)
    assert set(written.variables) == set(expected.variables)
    for name in set(expected.variables) - TIMINGS.get(group, set()):
        a, b = written[name].values, expected[name].values
        assert a.dtype == b.dtype and a.shape == b.shape, name
        same = np.array_equal(a, b, equal_nan=True) if a.dtype.kind in "fc" else np.array_equal(a, b)
        assert same, f"{group}/{name} differs from the uninterrupted run"
    for key in ("settings", "identity", "complete", "units_done"):
        assert written.attrs[key] == expected.attrs[key], key
    assert written.attrs["complete"] is True
    assert not (path / ".submerge.lock").exists()
    assert not list(path.rglob("*.partial"))
    assert Store(path).consolidation() == "current"  # consolidated again by the resumed run


@pytest.fixture(scope="session")
def references(kit, diag, tmp_path_factory):
    """Per driver: (reference store, the write points of its group in an uninterrupted run: 1-based numbers among
    all the run's file writes — every write, or for a command that writes several groups those into its group)."""
    def build(root: Path) -> dict:
        found = {}
        for driver, (group, argv) in DRIVERS.items():
            out = root / f"ref_{driver}" / "ref.zarr"
            log = out.with_suffix(".writes")
            code, output = diag(*argv(kit), "--out", out, env={"SUBMERGE_WRITE_LOG": str(log)})
            assert code == 0, output
            writes = [line for line in log.read_text().splitlines() if line.startswith("write")]
            assert Store(out).is_complete(group)
            if driver in SHARED:
                points = [n for n, line in enumerate(writes, 1) if _group_of(line.split(" ", 1)[1], out) == group]
            else:
                points = list(range(1, len(writes) + 1))
            assert points, f"{driver}: no write into {group}"
            found[driver] = (out, points)
        return found

    return {driver: (Path(out), points) for driver, (out, points) in
            _built_once(tmp_path_factory, "fault_references", build).items()}


EXIT = {"kill": -signal.SIGKILL, "interrupt": 130, "nospace": 2}


def _fault_then_resume(kit, diag, references, tmp_path, driver: str, action: str, fraction: float) -> None:
    group, argv = DRIVERS[driver]
    reference, points = references[driver]
    index = max(1, min(len(points), round(fraction * len(points))))
    point = points[index - 1]
    out = tmp_path / f"{driver}-{action}-{point}.zarr"
    code, output = diag(*argv(kit), "--out", out, env={"SUBMERGE_FAULT_AT": f"write:{point}:{action}"})
    assert code == EXIT[action], f"write {point} ({group}'s write point {index}/{len(points)}): exit {code}\n{output}"
    if action == "interrupt":
        assert "run the same command to resume" in output and "Traceback" not in output and "never retrieved" not in output
        assert not (out / ".submerge.lock").exists()  # released on the way out
    if action == "nospace":  # a store write, or (compare) a merge write into its scratch folder
        assert "could not write the" in output and "File too large" in output and "Traceback" not in output
    if Store(out).exists():  # consolidated metadata, if any, describes the files as they are
        assert Store(out).consolidation() != "stale", f"write {point} ({group}'s {index}/{len(points)})"
    code, output = diag(*argv(kit), "--out", out)
    assert code == 0, f"resume after {action} at write {point} ({group}'s {index}/{len(points)}):\n{output}"
    _assert_same_store(out, reference, group)
    if os.environ.get("SUBMERGE_FAULT_PROGRESS"):  # a long matrix says how far it got
        with open(os.environ["SUBMERGE_FAULT_PROGRESS"], "a") as progress:
            progress.write(f"{driver} {action} {index}/{len(points)} (write {point}) resumed equal\n")


QUICK = [("linearity", "interrupt", 0.75), ("linearity", "nospace", 0.3), ("alpha", "kill", 0.6),
         ("interference", "kill", 0.4), ("evidence", "kill", 0.5), ("evidence", "interrupt", 0.9),
         ("projection", "kill", 0.5), ("eval", "interrupt", 0.6), ("compare", "kill", 0.3),
         ("compare", "nospace", 0.7)]


@pytest.mark.parametrize(("driver", "action", "fraction"), QUICK, ids=[f"{d}-{a}-{f}" for d, a, f in QUICK])
def test_fault_then_resume_equals_uninterrupted_run(kit, diag, references, tmp_path, driver, action, fraction):
    _fault_then_resume(kit, diag, references, tmp_path, driver, action, fraction)


@pytest.mark.skipif(not os.environ.get("SUBMERGE_FAULT_MATRIX"),
                    reason="long: set SUBMERGE_FAULT_MATRIX=N to fault every N-th write point (1: all)")
@pytest.mark.parametrize("driver", list(DRIVERS))
@pytest.mark.parametrize("action", ["kill", "interrupt", "nospace"])
def test_every_write_point(kit, diag, references, tmp_path, driver, action):
    _, points = references[driver]
    stride = int(os.environ["SUBMERGE_FAULT_MATRIX"])
    offset = {"kill": 0, "interrupt": 1, "nospace": 2}[action] % stride
    for index in range(1 + offset, len(points) + 1, stride):
        _fault_then_resume(kit, diag, references, tmp_path, driver, action, index / len(points))


# ------------------------------------------------------------------ commands that write files: merge, plan

FILE_COMMANDS = {
    "merge": lambda kit, references, out: ["merge", "--method", "ties", "--model", kit["base"],
                                           "-f", f"math={kit['tuned']['math']}", "-f", f"code={kit['tuned']['code']}",
                                           "--out", out, "--no-progress"],
    "plan": lambda kit, references, out: ["plan", references["alpha"][0], "--out", out, "--granularity", "layer"],
}


def _without_provenance(text: str) -> dict:
    import yaml

    content = yaml.safe_load(text)
    content.pop("provenance", None)
    return content


def _same_output(out: Path, reference: Path) -> None:
    """A merge folder (every file byte for byte; the record but its provenance) or a plan file (but its
    provenance) equal to the uninterrupted run's."""
    if reference.is_file():
        assert _without_provenance(out.read_text()) == _without_provenance(reference.read_text())
        assert not list(out.parent.glob(f"*{out.name}.*.partial"))
        return
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for file in reference.iterdir():
        if file.name == "submerge_merge.yaml":
            assert _without_provenance((out / file.name).read_text()) == _without_provenance(file.read_text())
        else:
            assert (out / file.name).read_bytes() == file.read_bytes(), file.name
    assert not list(out.parent.glob(f"{out.name}.partial-*"))  # the killed run's staging folder was removed


@pytest.fixture(scope="session")
def file_references(kit, diag, references, tmp_path_factory):
    """Per command: (its output in an uninterrupted run, its number of write points)."""
    found = {}
    for command, argv in FILE_COMMANDS.items():
        root = tmp_path_factory.mktemp(f"ref_{command}")
        out, log = root / ("plan.yaml" if command == "plan" else "merged"), root / "writes"
        code, output = diag(*argv(kit, references, out), env={"SUBMERGE_WRITE_LOG": str(log)})
        assert code == 0, output
        found[command] = (out, sum(line.startswith("write") for line in log.read_text().splitlines()))
    return found


def _file_fault_then_rerun(kit, diag, references, file_references, tmp_path, command, action, point) -> None:
    reference, _ = file_references[command]
    out = tmp_path / f"{command}-{action}-{point}" / reference.name
    code, output = diag(*FILE_COMMANDS[command](kit, references, out),
                        env={"SUBMERGE_FAULT_AT": f"write:{point}:{action}"})
    assert code == EXIT[action], f"{command}: write {point}: exit {code}\n{output}"
    assert "Traceback" not in output
    assert not out.exists()  # nothing half-written where the output goes
    code, output = diag(*FILE_COMMANDS[command](kit, references, out))
    assert code == 0, f"{command}: rerun after {action} at write {point}:\n{output}"
    _same_output(out, reference)


FILE_QUICK = [("merge", "kill", 0.5), ("merge", "nospace", 0.9), ("plan", "kill", 1.0), ("plan", "nospace", 1.0)]


@pytest.mark.parametrize(("command", "action", "fraction"), FILE_QUICK, ids=[f"{c}-{a}-{f}" for c, a, f in FILE_QUICK])
def test_file_fault_then_rerun_equals_uninterrupted_run(kit, diag, references, file_references, tmp_path, command,
                                                        action, fraction):
    points = file_references[command][1]
    point = max(1, min(points, round(fraction * points)))
    _file_fault_then_rerun(kit, diag, references, file_references, tmp_path, command, action, point)


@pytest.mark.skipif(not os.environ.get("SUBMERGE_FAULT_MATRIX"),
                    reason="long: set SUBMERGE_FAULT_MATRIX=N to fault every N-th write point (1: all)")
@pytest.mark.parametrize("command", list(FILE_COMMANDS))
@pytest.mark.parametrize("action", ["kill", "interrupt", "nospace"])
def test_every_file_write_point(kit, diag, references, file_references, tmp_path, command, action):
    stride = int(os.environ["SUBMERGE_FAULT_MATRIX"])
    offset = {"kill": 0, "interrupt": 1, "nospace": 2}[action] % stride
    for point in range(1 + offset, file_references[command][1] + 1, stride):
        _file_fault_then_rerun(kit, diag, references, file_references, tmp_path, command, action, point)


def test_write_points_per_command(references, file_references, capsys):
    """The number of write points of each command (the full matrix faults each of them three ways)."""
    counts = {**{driver: len(points) for driver, (_, points) in references.items()},
              **{command: points for command, (_, points) in file_references.items()}}
    with capsys.disabled():
        print("\nwrite points per command:", json.dumps(counts))
    assert all(count > 0 for count in counts.values()), counts


def test_fault_in_a_consolidated_store(kit, diag, references, tmp_path):
    """A run into a store that holds a consolidated group, killed at its first write (removing the consolidated
    metadata), in the middle, or at its last (consolidating again): the store never holds consolidated metadata
    that differs from its files, and the resumed run equals an uninterrupted one and consolidates the store."""
    import shutil

    group, argv = DRIVERS["alpha"]
    earlier = references["interference"][0]
    counted, log = tmp_path / "counted.zarr", tmp_path / "counted.writes"
    shutil.copytree(earlier, counted)
    code, output = diag(*argv(kit), "--out", counted, env={"SUBMERGE_WRITE_LOG": str(log)})
    assert code == 0, output
    writes = [line for line in log.read_text().splitlines() if line.startswith("write")]
    assert writes[0].endswith(f"{counted}/zarr.json") and writes[-1].endswith(f"{counted}/zarr.json")
    for point, state in ((1, "current"), (len(writes) // 2, "absent"), (len(writes), "absent")):
        out = tmp_path / f"point{point}.zarr"
        shutil.copytree(earlier, out)
        code, output = diag(*argv(kit), "--out", out, env={"SUBMERGE_FAULT_AT": f"write:{point}:kill"})
        assert code == -signal.SIGKILL, output
        assert Store(out).consolidation() == state, f"write {point}/{len(writes)}"
        code, output = diag(*argv(kit), "--out", out)
        assert code == 0, output
        _assert_same_store(out, references["alpha"][0], group)
        _assert_same_store(out, earlier, "interference")


def test_killed_run_leaves_a_stale_lock_that_is_taken_over(kit, diag, references, tmp_path):
    group, argv = DRIVERS["linearity"]
    out = tmp_path / "stale.zarr"
    code, _ = diag(*argv(kit), "--out", out, env={"SUBMERGE_FAULT_AT": "append:2:kill"})
    assert code == -signal.SIGKILL
    holder = json.loads((out / ".submerge.lock").read_text())
    assert Store(out).status()[group].state == "partial"
    code, output = diag(*argv(kit), "--out", out)
    assert code == 0, output
    assert f"stale lock of process {holder['pid']}" in output and "is no longer running" in output
    _assert_same_store(out, references["linearity"][0], group)


def test_real_file_size_limit(kit, diag, references, tmp_path):
    """`ulimit -f` for the whole run: the first file over the limit fails; the message names the store."""
    group, argv = DRIVERS["interference"]
    out = tmp_path / "ulimit.zarr"
    code, output = diag(*argv(kit), "--out", out, fsize=1500)
    assert code == 2 and "could not write the store" in output and "Traceback" not in output, output
    code, output = diag(*argv(kit), "--out", out)
    assert code == 0, output
    _assert_same_store(out, references["interference"][0], group)


def test_second_concurrent_writer_is_refused(kit, diag, references, tmp_path):
    group, argv = DRIVERS["linearity"]
    out = tmp_path / "busy.zarr"
    first = diag(*argv(kit), "--out", out, env={"SUBMERGE_FAULT_AT": "append:1:stop"}, background=True)
    try:
        deadline = time.time() + 120
        while not _stopped(first["pid"]):
            assert time.time() < deadline, "the first writer never reached its first append"
            time.sleep(0.1)
        code, output = diag(*argv(kit), "--out", out)
        assert code == 2 and f"being written by process {first['pid']}" in output, output
        assert "Traceback" not in output
        assert json.loads((out / ".submerge.lock").read_text())["pid"] == first["pid"]
    finally:
        os.kill(first["pid"], signal.SIGCONT)
    code, output = diag.wait(first)
    assert code == 0, output
    _assert_same_store(out, references["linearity"][0], group)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def test_changed_inputs_are_refused(kit, diag, references, tmp_path):
    group, argv = DRIVERS["linearity"]
    out = tmp_path / "inputs.zarr"
    reference = references["linearity"][0]
    import shutil

    shutil.copytree(reference, out)
    before = Store(out).dataset(group)
    swapped = ["linearity", *_inputs(kit, swap=True), *argv(kit)[len(_inputs(kit)) + 1:]]
    code, output = diag(*swapped, "--out", out)
    assert code == 2 and "fine-tune 'math'" in output and str(kit["tuned"]["math"]) in output, output
    assert "fine-tune 'code'" in output and "--force" in output and "Traceback" not in output
    changed = kit["root"] / "math_changed.jsonl"
    changed.write_text(kit["data"]["math"].read_text().replace("a", "b", 1))
    data = {"math": changed, "code": kit["data"]["code"]}
    code, output = diag("linearity", *_inputs(kit, data=data), *argv(kit)[len(_inputs(kit)) + 1:], "--out", out)
    assert code == 2 and "data 'math'" in output and "Traceback" not in output, output
    after = Store(out).dataset(group)
    assert after.identical(before)  # refused runs leave the store as it was
    code, output = diag(*swapped, "--out", out, "--force")
    assert code == 0, output
    assert not np.array_equal(Store(out).dataset(group).nonlinearity_score.values,
                              before.nonlinearity_score.values, equal_nan=True)


RAY = ["--ray", "auto", "--workers", "2", "--threads", "1"]  # layers as tasks of two workers of a local Ray instance


@pytest.fixture(scope="session")
def ray_writes(kit, diag, references, tmp_path_factory) -> int:
    """The number of file writes of an uninterrupted `diag linearity` on Ray (whose store equals one process's)."""
    pytest.importorskip("ray")
    group, argv = DRIVERS["linearity"]
    counted = tmp_path_factory.mktemp("ray") / "counted.zarr"
    log = counted.with_suffix(".writes")
    code, output = diag(*argv(kit), *RAY, "--out", counted, env={"SUBMERGE_WRITE_LOG": str(log)})
    assert code == 0, output
    _assert_same_store(counted, references["linearity"][0], group)
    return sum(line.startswith("write") for line in log.read_text().splitlines())


RAY_WRITE_POINT = pytest.mark.skipif(
    not os.environ.get("SUBMERGE_FAULT_MATRIX"),
    reason="timing-dependent (set SUBMERGE_FAULT_MATRIX): on Ray the middle write's place in the run varies; in 2 of "
           "10 runs under load a kill there landed inside the first unit's write and left the group 'corrupt' (stop "
           "31). A group with no committed unit now reads as partial "
           "(test_store.py::test_a_first_unit_cut_mid_write_is_partial_with_nothing_written_and_resumes)")


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
@pytest.mark.parametrize("where", ["append", pytest.param("write", marks=RAY_WRITE_POINT)])
@pytest.mark.parametrize("action", ["kill", "interrupt"])
def test_a_ray_driver_faulted_inside_its_run_resumes_to_the_one_process_store(kit, diag, references, request,
                                                                              tmp_path, action, where):
    """One point inside the Ray driver: `diag linearity --ray auto --workers 2` killed or interrupted while its
    workers hold tasks, at its second unit's append (arrays written, row count not yet committed) or at the middle
    of its writes; the same command then resumes on Ray, and the store equals the one-process run's bit for bit
    (the engine is provenance only). The driver alone writes, in order."""
    group, argv = DRIVERS["linearity"]
    ray_writes = request.getfixturevalue("ray_writes") if where == "write" else None  # a whole Ray run: only here
    point = 2 if where == "append" else ray_writes // 2
    at = f"{where} {point}" + (f" (of {ray_writes} writes)" if ray_writes else "")
    out = tmp_path / f"ray-{action}-{where}.zarr"
    code, output = diag(*argv(kit), *RAY, "--out", out, env={"SUBMERGE_FAULT_AT": f"{where}:{point}:{action}"})
    assert code == EXIT[action], f"{at}: exit {code}\n{output}"
    assert Store(out).status()[group].state == "partial"
    if action == "interrupt":
        assert "run the same command to resume" in output and "Traceback" not in output
    code, output = diag(*argv(kit), *RAY, "--out", out)
    assert code == 0, f"resume on Ray after {action} at {at}:\n{output}"
    _assert_same_store(out, references["linearity"][0], group)
    assert Store(out).dataset(group).attrs["provenance"]["engine"]["workers"] == 2
