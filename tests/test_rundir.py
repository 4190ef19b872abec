"""keel.rundir.RunDir: the run folder's layout, and its one owner.

A real run's folder (a grid job's: the trainer's files plus the grid's) holds exactly what
RunDir declares; and no module of keel but keel/rundir.py spells a run folder's file name
(keel/train/checkpoint.py owns the names inside ``checkpoints/``).
"""

import ast
from pathlib import Path

from conftest import REPO

from keel.rundir import RunDir

PKG = REPO / "keel"

# The run-folder names, and those inside RUN/checkpoints/ (keel.train.checkpoint's: LATEST, step_name).
RUN_NAMES = {RunDir.CONFIG, RunDir.METRICS, RunDir.CHECKPOINTS, RunDir.TOKENIZER, RunDir.LOSS_PLOT, RunDir.SAMPLE,
             RunDir.LOCK, RunDir.TENSORBOARD, RunDir.WANDB, RunDir.WANDB_ID, RunDir.JOB, RunDir.LOG, RunDir.RESULT}
CHECKPOINT_NAMES = {"latest"}
CHECKPOINT_PREFIX = "step_"
OWNERS = {"keel/rundir.py": RUN_NAMES, "keel/train/checkpoint.py": CHECKPOINT_NAMES | {CHECKPOINT_PREFIX}}

# (module, literal): (how many times, why it is not RunDir's). Another name or count fails the test.
ALLOWED = {
    ("keel/config.py", "tensorboard"): (1, "a value of train.loggers (a logger's name), not a path"),
    ("keel/config.py", "wandb"): (1, "a value of train.loggers (a logger's name), not a path"),
    ("keel/train/loggers.py", "tensorboard"): (3, "the logger's name and its package's (_require), not a path"),
    ("keel/train/loggers.py", "wandb"): (2, "the wandb package's name and extra (_require), not a path"),
    ("keel/train/trainer.py", "tokenizer.json"): (1, "the dataset folder's tokenizer (keel.data's layout), copied "
                                                     "into RunDir.tokenizer"),
    ("keel/io.py", "tokenizer.json"): (1, "HF_TOKENIZER: a Hugging Face model folder's tokenizer"),
    ("keel/data/loader.py", "tokenizer.json"): (1, "a prepared dataset's tokenizer (keel.data's layout)"),
    ("keel/data/prepare.py", "tokenizer.json"): (7, "a prepared dataset's tokenizer and a tokenizer path given "
                                                    "to keel prepare (keel.data's layout)"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _run_folder_name(value: str) -> str | None:
    """The run-folder (or checkpoints/) name a string literal spells as a path or path part, or None.
    Prose (a message or comment that names a file among other words) is not a spelling."""
    part = value.strip("/")
    head = part.split("/")[0]
    if part in RUN_NAMES | CHECKPOINT_NAMES or (head in RUN_NAMES and "/" in part):
        return part if part in RUN_NAMES | CHECKPOINT_NAMES else head
    if part.startswith(CHECKPOINT_PREFIX) and " " not in part:
        return CHECKPOINT_PREFIX
    return None


def run_folder_literals(pkg: Path = PKG) -> dict[tuple[str, str], list[int]]:
    """``{(module path, name): [line, ...]}`` of every string literal (f-string parts included,
    docstrings not) in ``pkg`` that spells a run-folder file name."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(pkg.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        rel = path.relative_to(pkg.parent).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                name = _run_folder_name(node.value)
                if name is not None:
                    found.setdefault((rel, name), []).append(node.lineno)
    return found


def test_run_folder_names_are_spelled_only_by_their_owner():
    bad = []
    for (module, name), lines in sorted(run_folder_literals().items()):
        if name in OWNERS.get(module, ()):
            continue
        allowed = ALLOWED.get((module, name), (0, ""))[0]
        if len(lines) != allowed:
            bad.append(f"{module}:{','.join(map(str, sorted(lines)))}: {name!r} ({len(lines)} spelled, {allowed} "
                       "allowed): take it from keel.rundir.RunDir (or keel.train.checkpoint inside checkpoints/)")
    found = run_folder_literals()
    stale = [f"{m}: {n!r}" for (m, n) in ALLOWED if (m, n) not in found]
    assert not bad and not stale, "\n".join(bad + [f"allowlisted but gone (drop it from ALLOWED): {s}" for s in stale])


def test_each_run_folder_name_is_declared_once():
    """One literal each in its owner (the ``step_`` prefix: the checkpoint module's name, glob and pattern)."""
    literals = run_folder_literals()
    for module, names in OWNERS.items():
        for name in names - {CHECKPOINT_PREFIX}:
            assert len(literals.get((module, name), [])) == 1, (module, name, literals.get((module, name)))


def test_the_scan_finds_a_spelling(tmp_path):
    """The test above would fail on a module that spells a run-folder name (as a path, an f-string
    part or a checkpoint folder) and passes prose and docstrings."""
    pkg = tmp_path / "keel"
    pkg.mkdir()
    (pkg / "m.py").write_text('"""RUN/metrics.jsonl: a docstring."""\n'
                              'A = run / "metrics.jsonl"\n'
                              'B = f"{run}/checkpoints/latest"\n'
                              'C = f"step_{step:08d}"\n'
                              'D = "no metrics.jsonl there"\n'
                              'E = ".keel.lock"\n')
    assert run_folder_literals(pkg) == {("keel/m.py", RunDir.METRICS): [2], ("keel/m.py", RunDir.CHECKPOINTS): [3],
                                        ("keel/m.py", CHECKPOINT_PREFIX): [4], ("keel/m.py", RunDir.LOCK): [6]}


def test_paths():
    rd = RunDir("runs/demo")
    assert rd.config == Path("runs/demo/config.toml") and rd.metrics == Path("runs/demo/metrics.jsonl")
    assert rd.checkpoints == Path("runs/demo/checkpoints") and rd.lock == Path("runs/demo/.keel.lock")
    assert [rd.job.name, rd.log.name, rd.result.name] == list(RunDir.GRID_FILES)
    assert RunDir.SETUP_FILES == {RunDir.LOCK, RunDir.JOB, RunDir.LOG}


def test_is_run(tmp_path):
    rd = RunDir(tmp_path)
    assert not rd.is_run()
    rd.config.write_text("[train]\nsteps = 3\n")  # another tool's config.toml
    assert not rd.is_run()
    rd.config.write_text("[model]\nn_layers = 2\n")
    assert rd.is_run()
    rd.config.write_text("[model\n")  # not TOML
    assert not rd.is_run()


def _entries(folder: Path) -> set[str]:
    return {p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()}


def test_a_grid_runs_folder_is_the_declared_layout(tiny_config, tmp_path):
    """One job of a grid (keel sweep's task, in this process): its folder holds the trainer's files
    (the jsonl logger: neither tensorboard/ nor wandb/) and the grid's, each where RunDir says."""
    from keel.experiments.grid import GridJob, run_grid
    from keel.experiments.sweep import train_task
    from keel.train.checkpoint import LATEST, step_name

    cfg = tiny_config()
    [result] = run_grid([GridJob("run", cfg.to_dict())], tmp_path / "grid", train_task, workers=0)
    assert result["status"] == "done", result
    rd = RunDir(tmp_path / "grid" / "run")
    declared = set(RunDir.TRAINING_FILES) - {RunDir.TENSORBOARD + "/", RunDir.WANDB + "/", RunDir.WANDB_ID}
    assert _entries(rd.path) == declared | set(RunDir.GRID_FILES)
    for path in (rd.config, rd.metrics, rd.tokenizer, rd.loss_plot, rd.sample, rd.lock, rd.job, rd.log, rd.result):
        assert path.is_file(), path
    assert rd.is_run() and rd.checkpoints.is_dir()
    steps = range(cfg.train.checkpoint_every, cfg.train.steps + 1, cfg.train.checkpoint_every)
    kept = list(steps)[-cfg.train.keep_checkpoints:]
    assert _entries(rd.checkpoints) == {LATEST} | {step_name(s) + "/" for s in kept}
    assert (rd.checkpoints / LATEST).read_text() == step_name(cfg.train.steps) + "\n"
