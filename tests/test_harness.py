"""Task accuracy through lm-evaluation-harness (`submerge.diagnostics.harness`): the demo kit's local tasks score what
their definitions say (known answers built from the model's own greedy generations), each model is the base instance
with θ0 + τ written into it, code runs only when allowed, results land in the store per (model, task) and resume.

Tiny toy models, a few records, short generations (the tests run on 2 shared CPU cores).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval")

from submerge.cli.report import summary_tables
from submerge.diagnostics import toy
from submerge.diagnostics.base_model import load_base_model
from submerge.diagnostics.harness import (
    ACCURACY,
    COMPARE_ACCURACY,
    HarnessError,
    HarnessSettings,
    TaskFiles,
    accuracy,
    accuracy_frame,
    model_in_memory,
)
from submerge.diagnostics.store import Store

GENERATION = 12  # tokens per generation (bytes of the toy tokenizer)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """A toy Llama trained a little on arithmetic text (so it writes digits), two fine-tunes, task data files."""
    import warnings

    root = tmp_path_factory.mktemp("harness")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        random_init = toy.build_model(root / "random", "llama", layers=2, hidden=32, heads=4, kv_heads=2)
        base = toy.finetune(random_init, root / "base", "math", steps=20, lr=1e-2, seed=3)
        tuned = {task: toy.finetune(base, root / task, task, steps=6, lr=3e-3, seed=i)
                 for i, task in enumerate(("math", "trivia"))}
    return {"root": root, "base": str(base), "tuned": {t: str(p) for t, p in tuned.items()}}


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _generations(kit, task: str, data: dict[str, str], model_dir: str | None = None) -> list[str]:
    """The harness's own filtered responses of `task` on `data` (its records in order), by the model `model_dir`."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = TaskFiles([task], data, skip=0, samples=None)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir or kit["base"], dtype=torch.float32).eval()
        lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(kit["base"]), batch_size=2)
        results = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(
            include_path=str(files.directory), include_defaults=False), gen_kwargs={"max_gen_toks": GENERATION}, log_samples=True,
            confirm_run_unsafe_code=True)
    finally:
        files.close()
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"][0] for s in samples]


PROMPTS = [f"Q: what is {a} plus {b}? A: " for a, b in ((3, 4), (12, 30), (7, 8), (41, 2), (5, 5), (60, 9))]


def test_local_tasks_score_their_definitions(kit, tmp_path):
    """Trivia: the normalised first line against the answer; GSM8K: the last number against the number after ####.
    Half the records are given the model's own answer (from a first pass), half another one: the accuracy is
    known before the second pass runs."""
    probe = {"trivia": _write(tmp_path / "probe_trivia.jsonl", [{"prompt": p, "completion": "x"} for p in PROMPTS]),
             "math": _write(tmp_path / "probe_math.jsonl", [{"prompt": p, "completion": "#### 0"} for p in PROMPTS])}
    said = {"trivia": _generations(kit, "demo_trivia", probe), "math": _generations(kit, "demo_gsm8k", probe)}

    def normal(text: str) -> str:
        text = re.sub(r"\s+", "", re.sub(r"(?i)\b(?:a|an|the)\b", "", text)).lower()
        return text.translate(str.maketrans("", "", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"))

    trivia = [{"prompt": p, "completion": s if i % 2 == 0 else "zebra crossing"}
              for i, (p, s) in enumerate(zip(PROMPTS, said["trivia"]))]
    numbers = [re.sub(r"[,$]|\.$", "", s) for s in said["math"]]  # the regex filter took the last number already
    math = [{"prompt": p, "completion": f"work\n#### {n if i % 2 == 0 else '987654'}"}
            for i, (p, n) in enumerate(zip(PROMPTS, numbers))]
    expected = {"demo_trivia": np.mean([normal(s) == normal(r["completion"]) for s, r in zip(said["trivia"], trivia)]),
                "demo_gsm8k": np.mean([i % 2 == 0 and n != "[invalid]" for i, n in enumerate(numbers)])}
    data = {"trivia": _write(tmp_path / "trivia.jsonl", trivia), "math": _write(tmp_path / "math.jsonl", math)}
    settings = HarnessSettings(("demo_trivia", "demo_gsm8k"), max_gen_toks=GENERATION, batch_size=2)
    scores = accuracy(kit["base"], {}, data, settings, skip=0, device="cpu", progress=False)
    table = accuracy_frame(scores)
    assert table.loc["base", "demo_trivia exact_match"] == pytest.approx(expected["demo_trivia"])
    assert table.loc["base", "demo_gsm8k exact_match"] == pytest.approx(expected["demo_gsm8k"])
    assert expected["demo_trivia"] >= 0.5 and (scores.documents.values == len(PROMPTS)).all()


def test_the_model_is_the_base_instance_with_the_finetune_written_in(kit):
    from safetensors.torch import load_file

    base = load_base_model(kit["base"], dtype="float32", device="cpu")
    before = {name: (p.data_ptr(), p.dtype) for name, p in base.model.named_parameters()}
    tuned = load_file(f"{kit['tuned']['math']}/model.safetensors")
    with model_in_memory(base, kit["tuned"]["math"], torch.float64) as model:
        for name, parameter in model.named_parameters():
            assert parameter.dtype == torch.float64  # the compute dtype
            torch.testing.assert_close(parameter.data, tuned[base.checkpoint_name(name)].double(), rtol=0, atol=1e-6)
    assert {name: (p.data_ptr(), p.dtype) for name, p in base.model.named_parameters()} == before  # put back
    # the same generations as the fine-tune loaded from its folder
    data = {"trivia": kit["root"] / "same.jsonl"}
    _write(data["trivia"], [{"prompt": p, "completion": "x"} for p in PROMPTS[:3]])
    from_disk = _generations(kit, "demo_trivia", {"trivia": str(data["trivia"])}, kit["tuned"]["math"])
    scores = accuracy(kit["base"], {"math": kit["tuned"]["math"]}, {"trivia": str(data["trivia"])},
                      HarnessSettings(("demo_trivia",), max_gen_toks=GENERATION, batch_size=2), skip=0, device="cpu",
                      progress=False)
    assert list(dict.fromkeys(scores.model.values)) == ["base", "math"]
    assert len(from_disk) == 3


def test_code_execution_needs_the_flag_and_pass_at_1_runs_the_tests(kit, tmp_path):
    import importlib.util

    from submerge.diagnostics.harness import TASK_CONFIGS

    with pytest.raises(HarnessError, match="EXECUTING the code"):
        HarnessSettings(("demo_humaneval",))
    with pytest.raises(HarnessError, match="humaneval"):
        HarnessSettings(("demo_trivia", "humaneval"))
    spec = importlib.util.spec_from_file_location("humaneval_utils", TASK_CONFIGS / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    doc = {"prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(2, 3) == 5\n", "entry_point": "add"}
    assert utils.pass_at_1(doc, ["    return a + b\n"]) == {"pass@1": 1.0}
    assert utils.pass_at_1(doc, ["    return a * b\n"]) == {"pass@1": 0.0}
    assert utils.pass_at_1(doc, ["    return (\n"]) == {"pass@1": 0.0}  # a syntax error
    assert not utils.passes("while True:\n    pass\n", time_limit=1.0)  # out of time
    # end to end: the toy model's completions run against the tests; the canonical one is not given to it
    records = [{**doc, "completion": "    return a + b\n"}, {**doc, "prompt": doc["prompt"] + "    return a + b\n"}]
    data = {"code": _write(tmp_path / "code.jsonl", records)}
    said = _generations(kit, "demo_humaneval", data)
    expected = np.mean([utils.passes(f"{r['prompt']}{s}\n\n{r['test']}\n\ncheck({r['entry_point']})\n")
                        for r, s in zip(records, said)])
    settings = HarnessSettings(("demo_humaneval",), allow_code_execution=True, max_gen_toks=GENERATION, batch_size=2)
    scores = accuracy(kit["base"], {}, data, settings, skip=0, device="cpu", progress=False)
    assert accuracy_frame(scores).loc["base", "demo_humaneval pass@1"] == pytest.approx(expected)


def test_results_go_to_the_store_per_model_and_task_and_resume(kit, tmp_path):
    data = {"trivia": _write(tmp_path / "trivia.jsonl", [{"prompt": p, "completion": "x"} for p in PROMPTS[:4]]),
            "math": _write(tmp_path / "math.jsonl", [{"prompt": p, "completion": "#### 7"} for p in PROMPTS[:4]])}
    settings = HarnessSettings(("demo_trivia", "demo_gsm8k"), max_gen_toks=GENERATION, batch_size=2)
    models = dict(kit["tuned"])
    arguments = {"skip": 1, "device": "cpu", "progress": False}
    reference = accuracy(kit["base"], models, data, settings, store=Store(tmp_path / "ref.zarr"), **arguments)
    assert list(zip(reference.model.values, reference.task.values)) == [
        (m, t) for m in ("base", "math", "trivia") for t in ("demo_trivia", "demo_gsm8k")]
    stored = Store(tmp_path / "ref.zarr")
    attrs = stored.group_attrs("accuracy")
    assert attrs["settings"]["harness"] and attrs["settings"]["tasks"] == ["demo_trivia", "demo_gsm8k"]
    assert "exact_match" in attrs["task_configs"]["demo_gsm8k"]["config"]
    assert attrs["task_configs"]["demo_trivia"]["records"] == 3  # the records after the first (skip 1)
    assert stored.consolidation() == "current"

    class Killed(Exception):
        pass

    seen = []

    def kill_after_three(label):
        seen.append(label)
        if len(seen) == 3:
            raise Killed

    store = Store(tmp_path / "resumed.zarr")
    with pytest.raises(Killed):
        accuracy(kit["base"], models, data, settings, store=store, on_unit=kill_after_three, **arguments)
    resumed = []
    result = accuracy(kit["base"], models, data, settings, store=store, on_unit=resumed.append, **arguments)
    assert resumed == ["math · demo_gsm8k", "trivia · demo_trivia", "trivia · demo_gsm8k"]  # the pairs not stored
    np.testing.assert_array_equal(result.value.values, reference.value.values)
    assert list(result.result.values) == list(reference.result.values)


def test_lm_evals_own_tasks_are_indexed_only_when_a_run_asks_for_one(kit, tmp_path):
    """Indexing lm-eval's shipped tasks takes ~16 s; a run of local tasks only skips it, a run naming one of lm-eval's
    tasks (gsm8k) has it, and an unknown name is refused either way."""
    from submerge.diagnostics.harness import LOCAL_TASKS, AccuracyRunner

    class Writer:  # what AccuracyRunner reads from a UnitWriter before it scores anything
        pieces, notes = None, []

        def note(self, extra):
            self.notes.append(extra)

    base = load_base_model(kit["base"], dtype="float32", device="cpu")
    data = {"trivia": _write(tmp_path / "trivia.jsonl", [{"prompt": p, "completion": "x"} for p in PROMPTS[:2]])}

    def runner(*tasks):
        return AccuracyRunner(base, HarnessSettings(tasks), data, Writer(), skip=0, compute=torch.float32)

    local = runner("demo_trivia")
    assert set(local.manager.all_tasks) <= set(LOCAL_TASKS)
    local.close()
    named = runner("demo_trivia", "gsm8k")
    assert {"demo_trivia", "gsm8k"} <= set(named.manager.all_tasks)
    named.close()
    with pytest.raises(HarnessError, match=r"unknown lm-eval task\(s\) \['demo_trivai'\]"):
        runner("demo_trivai")


def test_lm_evals_environment_report_is_skipped_and_put_back(kit, tmp_path, monkeypatch):
    """simple_evaluate's closing environment report (torch's collect_env: ~3.6 s a call; `git describe` in the
    working directory, which prints "fatal: not a git repository" outside one) is not run for any (model, task),
    and lm-eval's functions are its own again afterwards."""
    import torch.utils.collect_env
    from lm_eval import evaluator

    calls = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: calls.append("env") or "")
    monkeypatch.setattr(evaluator, "get_git_commit_hash", lambda: calls.append("git"))
    original = evaluator.add_env_info, evaluator.get_git_commit_hash
    data = {"trivia": _write(tmp_path / "trivia.jsonl", [{"prompt": p, "completion": "x"} for p in PROMPTS[:2]])}
    scores = accuracy(kit["base"], {"math": kit["tuned"]["math"]}, data,
                      HarnessSettings(("demo_trivia",), max_gen_toks=4, batch_size=2), skip=0, device="cpu",
                      progress=False)
    assert list(dict.fromkeys(scores.model.values)) == ["base", "math"]
    assert calls == []
    assert (evaluator.add_env_info, evaluator.get_git_commit_hash) == original


def test_cli_refuses_code_tasks_without_the_flag_and_says_why(kit):
    from typer.testing import CliRunner

    from submerge.cli.main import app

    runner = CliRunner()
    help_text = " ".join(runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "300"}).output.split())
    assert "EXECUTE the code" in help_text and "--allow-code-execution" in help_text
    result = runner.invoke(app, ["eval", "--model", kit["base"], "--finetuned", f"math={kit['tuned']['math']}",
                                 "--data", "math=/nonexistent.jsonl", "--lm-eval", "demo_humaneval"],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "--allow-code-execution" in result.output and "Traceback" not in result.output


def test_compare_scores_every_model_and_ranks_by_accuracy(kit, tmp_path):
    """diag compare --lm-eval: the references and each merge get accuracy rows (group compare_accuracy); the
    leaderboard has the accuracy columns and ranks by their mean with rank_by="accuracy"; a killed compare resumes
    the accuracy per (model, task)."""
    from submerge.merge.compare import CompareError, compare, leaderboard

    records = [{"prompt": p, "completion": "x"} for p in PROMPTS[:4]]
    data = {"math": _write(tmp_path / "math.jsonl", [{"text": f"{r['prompt']}7"} | r for r in records]),
            "trivia": _write(tmp_path / "trivia.jsonl", [{"text": f"{r['prompt']}7"} | r for r in records])}
    settings = HarnessSettings(("demo_trivia",), max_gen_toks=GENERATION, batch_size=2)
    run = {"methods": ["task-arithmetic"], "tune": None, "fit": 2, "samples": 2, "max_tokens": 32, "batch_size": 2,
           "dtype": "float32", "device": "cpu", "progress": False, "lm_eval": settings}
    store = Store(tmp_path / "compare.zarr")
    result = compare(kit["base"], kit["tuned"], data, store=store, **run)
    labels = ["base", "finetuned:math", "finetuned:trivia", "task-arithmetic"]
    assert list(result.method.values) == labels and list(result.benchmark.values) == ["demo_trivia exact_match"]
    scores = store.dataset("compare_accuracy")
    assert list(scores.model.values) == labels and (scores.documents.values == 2).all()
    np.testing.assert_array_equal(result.accuracy.values[:, 0], scores.value.values)
    table = leaderboard(result, rank_by="accuracy")
    assert list(table.columns[-2:]) == ["demo_trivia exact_match", "mean accuracy"]
    assert table["mean accuracy"].is_monotonic_decreasing
    assert leaderboard(result, rank_by="demo_trivia exact_match")["demo_trivia exact_match"].is_monotonic_decreasing
    with pytest.raises(CompareError, match="one of \\['demo_trivia exact_match'\\]"):
        leaderboard(result, rank_by="demo_gsm8k exact_match")
    # the merge's accuracy is that of its checkpoint scored on its own (diag eval --lm-eval on the kept merge)
    kept = compare(kit["base"], kit["tuned"], data, keep=tmp_path / "kept", **{**run, "methods": ["task-arithmetic"]})
    alone = accuracy(kit["base"], {"ta": str(tmp_path / "kept" / "task-arithmetic")}, data, settings, skip=2,
                     device="cpu", progress=False)
    assert accuracy_frame(alone).loc["ta"].tolist() == kept.accuracy.sel({"method": "task-arithmetic"}).values.tolist()


def test_diag_eval_lm_eval_writes_the_accuracy_group(kit, tmp_path):
    from typer.testing import CliRunner

    from submerge.cli.main import app

    data = _write(tmp_path / "trivia.jsonl", [{"prompt": p, "completion": "x"} for p in PROMPTS[:3]])
    out = tmp_path / "eval.zarr"
    arguments = ["eval", "--model", kit["base"], "--finetuned", f"math={kit['tuned']['math']}", "--data",
                 f"trivia={data}", "--skip", "1", "--samples", "2", "--max-tokens", "32", "--device", "cpu",
                 "--dtype", "float32", "--no-progress", "--out", str(out), "--lm-eval", "demo_trivia",
                 "--max-gen-toks", str(GENERATION), "--lm-eval-batch-size", "2"]
    result = CliRunner().invoke(app, arguments, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "Task accuracy (lm-evaluation-harness)" in result.output and "Wrote group accuracy" in result.output
    stored = Store(out)
    assert stored.is_complete("eval") and stored.is_complete("accuracy") and stored.consolidation() == "current"
    scores = stored.dataset("accuracy")
    assert list(scores.model.values) == ["base", "math"] and (scores.documents.values == 2).all()
    # the command's accuracy table is the one `diag report` prints (its owner ACCURACY), with its figure
    title = ACCURACY.table_title(scores)
    printed = title + result.stdout.split("Wrote group accuracy")[0].split(title)[1].rstrip("\n")
    assert printed.count("\n") >= 5, printed  # a title, a header and two models
    report = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "figures")], env={"COLUMNS": "300"})
    assert report.exit_code == 0, report.output
    assert printed in report.stdout, (printed, report.stdout)
    assert (tmp_path / "figures" / "accuracy.png").is_file() and (tmp_path / "figures" / "eval.png").is_file()
    tables = summary_tables(out)
    assert list(tables) == ["eval", "accuracy"]
    assert tables["accuracy"][("demo_trivia exact_match", "mean")].tolist() == scores.value.values.tolist()


def test_cli_compare_prints_the_accuracy_table_the_report_prints(kit, tmp_path):
    """diag compare --lm-eval prints its leaderboard with the accuracy columns, then group compare_accuracy's table
    (every model: the base, the fine-tunes, each merge), which `diag report` prints again."""
    from typer.testing import CliRunner

    from submerge.cli.main import app

    records = [{"prompt": p, "completion": "x", "text": f"{p}7"} for p in PROMPTS[:4]]
    data = {task: _write(tmp_path / f"{task}.jsonl", records) for task in ("math", "trivia")}
    out = tmp_path / "compare.zarr"
    arguments = ["compare", "--model", kit["base"], *[f"--finetuned={t}={p}" for t, p in kit["tuned"].items()],
                 *[f"--data={t}={p}" for t, p in data.items()], "--methods", "task-arithmetic", "--fit", "2",
                 "--samples", "2", "--max-tokens", "32", "--batch-size", "2", "--dtype", "float32", "--device", "cpu",
                 "--no-progress", "--out", str(out), "--lm-eval", "demo_trivia", "--max-gen-toks", str(GENERATION),
                 "--lm-eval-batch-size", "2", "--rank-by", "accuracy", "--tune", "none"]
    result = CliRunner().invoke(app, arguments, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "Wrote group compare of" in result.output and "and compare_accuracy" in result.output
    scores = Store(out).dataset("compare_accuracy")
    title = COMPARE_ACCURACY.table_title(scores)
    printed = title + result.stdout.split("Wrote group")[0].split(title)[1].rstrip("\n")
    assert printed.count("\n") >= 7, printed  # a title, a header and four models
    report = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "figures")], env={"COLUMNS": "300"})
    assert report.exit_code == 0, report.output
    assert printed in report.stdout, (printed, report.stdout)
    assert (tmp_path / "figures" / "compare_accuracy.png").is_file()
    assert list(summary_tables(out))[-2:] == ["compare", "compare_accuracy"]


def test_accuracy_table_known_answer():
    """The groups' table: per model, each task's first metric ± its standard error; the figure draws it."""
    import xarray as xr

    rows = [("base", "t1", "exact_match", "none", 0.25, 0.1), ("base", "t1", "other", "none", 9.0, 1.0),
            ("base", "t2", "pass@1", "f", 0.5, np.nan), ("m", "t1", "exact_match", "none", 0.75, 0.2),
            ("m", "t1", "other", "none", 8.0, 1.0), ("m", "t2", "pass@1", "f", 1.0, 0.0)]
    model, task, metric, filter_name, value, stderr = map(list, zip(*rows))
    dataset = xr.Dataset({"value": ("result", value), "stderr": ("result", stderr),
                          "documents": ("result", [4] * 6), "seconds": ("result", [1.0] * 6)},
                         coords={"result": [" · ".join(r[:4]) for r in rows], "model": ("result", model),
                                 "task": ("result", task), "metric": ("result", metric),
                                 "filter": ("result", filter_name)})
    table = ACCURACY.summary(dataset)
    assert list(table.index) == ["base", "m"]
    assert list(table.columns) == [("t1 exact_match", "mean"), ("t1 exact_match", "stderr"), ("t2 pass@1", "mean"),
                                   ("t2 pass@1", "stderr")]
    np.testing.assert_array_equal(table.to_numpy(), [[0.25, 0.1, 0.5, np.nan], [0.75, 0.2, 1.0, 0.0]])
    from submerge.diagnostics.tables import render_table

    rendered = render_table(table, "t")
    assert [column.header for column in rendered.columns] == ["model", "t1 exact_match", "t2 pass@1"]
    assert list(rendered.columns[1].cells) == ["0.25 ± 0.1", "0.75 ± 0.2"]
    assert list(rendered.columns[2].cells) == ["0.5", "1 ± 0"]
    figure = ACCURACY.figures["accuracy"](dataset, "base: x")
    assert figure is not None and len(figure.axes[0].patches) == 4  # two models × two tasks
    assert ACCURACY.figures["accuracy"](dataset.isel(result=[]), "") is None
