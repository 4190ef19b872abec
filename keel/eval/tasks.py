"""Benchmark tasks through lm-evaluation-harness (``lm_eval``), one task at a time.

:func:`evaluate_tasks` scores a :class:`keel.hf.KeelForCausalLM` with
``lm_eval.simple_evaluate(model=HFLM(pretrained=<model>, tokenizer=<PreTrainedTokenizerFast>), ...)``;
:func:`run_tasks` does the same for a native :class:`keel.model.Transformer` and its
``tokenizers.Tokenizer`` (the trainer calls it every ``train.eval_tasks_every`` steps).

Task names are looked up first in the shipped example folder (:data:`EXAMPLE_TASK_DIR`:
``keel_python_completion``, 20-item multiple choice; ``keel_python_paragraphs``, rolling
log-likelihood over six paragraphs; ``keel_python_generate``, 20 greedy line completions,
a ``generate_until`` task) and in ``task_dir``; only names found in neither
load lm-eval's own registry (indexing it takes tens of seconds), and only when some file of
lm-eval's task folder mentions them: a mistyped name is refused in about a second, with the
nearest known names. Task YAMLs in those
folders may name local files: ``dataset_path: json`` with ``dataset_kwargs: {data_files:
...}``; relative ``data_files`` paths are resolved against the YAML's folder. The shipped
tasks read their data with a ``custom_dataset`` function beside them, so they also work
with plain ``lm_eval --include_path``.

Offline: each task is loaded and scored on its own. A task whose dataset cannot be loaded
(no network, not in the ``datasets`` cache) is reported in one line, ``task X: dataset could
not be loaded (offline?): ...``, and the other tasks still run; so is a task lm-eval cannot
score (``task X: could not be scored: ...``, e.g. a continuation longer than the model's window). Needs
``pip install -e .[eval]`` (lm_eval with its hf extra, transformers).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import logging
import math
import os
import random
from pathlib import Path
from typing import Any

import huggingface_hub.constants as hub_constants
import numpy as np
import torch
from tqdm import tqdm

from keel.data.sources import check_hub_reachable, hub_errors
from keel.errors import KeelError
from keel.train.callbacks import Callback, StepState
from keel.train.dist import barrier

log = logging.getLogger(__name__)

EXAMPLE_TASK_DIR = Path(__file__).resolve().parent / "example_tasks"


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def _quiet_lm_eval(level: int = logging.ERROR):
    """Silence lm_eval's and transformers' info/warning chatter for the duration."""
    loggers = [logging.getLogger(n) for n in ("lm_eval", "transformers", "datasets", "accelerate")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, old):
            lg.setLevel(lvl)


@contextlib.contextmanager
def _no_progress_bars(quiet: bool = True):
    """Without ``quiet``: nothing. With it: lm-eval's tqdm bars (building requests, tokenizing,
    running requests) and ``datasets``' bars are switched off for the duration."""
    if not quiet:
        yield
        return

    import datasets  # installed with lm_eval (extra [eval]); ~2 s to import

    def silent_tqdm(*args, **kwargs):  # callers pass disable= themselves: force it
        kwargs["disable"] = True
        return tqdm(*args, **kwargs)

    modules = [importlib.import_module(m) for m in ("lm_eval.api.task", "lm_eval.api.model",
                                                     "lm_eval.models.huggingface")]
    saved = [(m, m.tqdm) for m in modules if hasattr(m, "tqdm")]
    for m, _ in saved:
        m.tqdm = silent_tqdm
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        for m, original in saved:
            m.tqdm = original
        if bars_were_on:
            datasets.enable_progress_bars()


LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")


def _needs_hub(spec) -> bool:
    """Whether loading a task spec (a name or a YAML dict) may fetch a dataset from the hub:
    False only for a YAML whose ``dataset_path`` is a local builder or an existing folder."""
    if not isinstance(spec, dict):
        return True
    path = str(spec.get("dataset_path", ""))
    return not (path in LOCAL_BUILDERS or Path(path).expanduser().is_dir())


@contextlib.contextmanager
def _hub_offline(offline: bool):
    """With ``offline``: huggingface_hub and datasets in offline mode (cache only) for the
    duration, so a dataset that is not cached fails at once instead of after retries."""
    if not offline:
        yield
        return
    import datasets.config  # installed with lm_eval (extra [eval]); ~2 s to import

    saved = hub_constants.HF_HUB_OFFLINE, getattr(datasets.config, "HF_HUB_OFFLINE", None)
    hub_constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


class _HubProbe:
    """Probes the hub once (:func:`keel.data.sources.check_hub_reachable`, ~3 s at most); the
    reason it is unreachable, or None."""

    def __init__(self):
        self.checked, self.reason = False, None

    def unreachable(self) -> str | None:
        if not self.checked:
            self.checked = True
            try:
                check_hub_reachable("lm-eval task data")
            except KeelError as e:
                self.reason = str(e)
        return self.reason


@contextlib.contextmanager
def _no_env_probe():
    """Skip simple_evaluate's environment report (``torch.utils.collect_env``: several ``pip``
    and ``git`` subprocesses, seconds per task, and a ``fatal: not a git repository`` line)."""
    import lm_eval.evaluator as ev  # optional extra [eval]: keel train imports this module without it

    stubs = {"add_env_info": lambda storage: None, "get_git_commit_hash": lambda: None}
    saved = {k: getattr(ev, k) for k in stubs if hasattr(ev, k)}
    for k in saved:
        setattr(ev, k, stubs[k])
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(ev, k, v)


@contextlib.contextmanager
def _keep_rng_state():
    """simple_evaluate seeds python's, numpy's and torch's global generators; put them back
    afterwards so that evaluation inside training does not change the training run."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _needs_lm_eval(e: ImportError) -> KeelError:
    return KeelError(f"keel eval needs lm-evaluation-harness: pip install -e .[eval] ({_first_line(e)})")


class _Tasks:
    """Task index over the example folder + ``task_dir``; lm-eval's registry only when needed."""

    def __init__(self, task_dir: str | Path | None = None):
        try:
            from lm_eval.tasks import TaskManager  # optional extra [eval]: keel train imports this module without it
        except ImportError as e:
            raise _needs_lm_eval(e) from None
        paths = [EXAMPLE_TASK_DIR]
        if task_dir is not None:
            task_dir = Path(task_dir)
            if not task_dir.is_dir():
                raise KeelError(f"--task-dir {task_dir} is not a folder")
            paths.append(task_dir)
        self.paths = paths
        self.local = TaskManager(include_path=[str(p) for p in paths], include_defaults=False)
        self._full = None

    def manager_for(self, name: str):
        if name in self.local.all_tasks:
            return self.local
        if self._full is None:
            from lm_eval.tasks import TaskManager  # optional extra [eval]: keel train imports this module without it

            self._full = TaskManager(include_path=[str(p) for p in self.paths], include_defaults=True)
        return self._full

    def unknown(self, name: str) -> str | None:
        """Why task ``name`` is found nowhere (one line, with the nearest known names), or None
        when it is found. A name that no file of lm-eval's task folder mentions is not in its
        registry (built from those files: :func:`_mentioned_by_lm_eval`), so a typo is refused
        without indexing the registry (seconds to tens of seconds)."""
        if name in self.local.all_tasks:
            return None
        if _mentioned_by_lm_eval(name) and name in self.manager_for(name).all_tasks:
            return None
        broken = self._broken_yaml(name)
        if broken is not None:
            return broken
        known = list(self.local.all_tasks) + (list(self._full.all_tasks) if self._full is not None else [])
        near = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        return f"unknown task (not in {', '.join(map(str, self.paths))} nor in lm-eval's registry){hint}"

    def _broken_yaml(self, name: str) -> str | None:
        """Why task ``name`` may be missing from ``--task-dir``: a YAML file there that names it (its file
        name, or its text) but does not load (lm-eval's index skips such a file without a word, and the task
        read as "unknown"); None when there is none."""
        from lm_eval.tasks._yaml_loader import load_yaml  # optional extra [eval]: keel train imports this module without it

        for folder in self.paths[1:]:
            for f in sorted(folder.rglob("*")):
                if f.suffix not in (".yaml", ".yml") or not f.is_file():
                    continue
                try:
                    if f.stem != name and name not in f.read_text(encoding="utf-8", errors="replace"):
                        continue
                    load_yaml(f, resolve_func=False)
                except Exception as e:  # noqa: BLE001 -- yaml's errors, a missing include, a bad tag: each is the reason
                    return f"{f} names it but does not load as a task file ({_first_line(e)})"
        return None

    @staticmethod
    def spec(manager, name: str) -> str | dict:
        """``name``, or the task's YAML as a dict with relative data_files made absolute."""
        entry = manager.task_index.get(name)
        path = getattr(entry, "yaml_path", None)
        if path is None or getattr(getattr(entry, "kind", None), "name", None) != "TASK":
            return name
        from lm_eval.tasks._yaml_loader import load_yaml  # optional extra [eval]: keel train imports this module without it

        cfg = load_yaml(path, resolve_func=True)
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        if (files is None and cfg.get("custom_dataset") is None) or cfg.get("task") != name:
            return name
        if files is None:  # a local loader function (the shipped tasks): the YAML as it is
            return cfg
        base = Path(path).parent

        def fix(p):
            if isinstance(p, str) and "://" not in p and not Path(p).expanduser().is_absolute():
                return str(base / p)
            if isinstance(p, list):
                return [fix(q) for q in p]
            if isinstance(p, dict):
                return {k: fix(v) for k, v in p.items()}
            return p

        cfg = dict(cfg)
        cfg["dataset_kwargs"] = dict(cfg["dataset_kwargs"], data_files=fix(files))
        return cfg


def _mentioned_by_lm_eval(name: str) -> bool:
    """Whether any file of lm-eval's task folder (``lm_eval/tasks``: its YAMLs, templates and
    helpers; bytecode caches left out) holds the text ``name``. lm-eval builds its registry from
    those files, so a task name none of them mentions is unknown: a raw scan (about 0.3 s) instead
    of the index (4 s on an idle machine; ``tests/test_reliability_v5.py`` checks that every name
    the installed registry holds is mentioned)."""
    import lm_eval.tasks  # optional extra [eval]; _Tasks has imported it already

    needle = name.encode("utf-8")
    for folder, dirs, files in os.walk(Path(lm_eval.tasks.__file__).parent):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            try:
                with open(Path(folder, f), "rb") as fh:
                    if needle in fh.read():
                        return True
            except OSError:
                return True  # unreadable: let the registry decide
    return False


def _load_task(manager, spec, hub: _HubProbe):
    """``manager.load([spec])``, or a one-line reason it failed. A task that needs the hub
    while the hub is unreachable is loaded in offline mode (from the datasets cache only), so
    it fails within seconds instead of after huggingface_hub's retries."""
    offline = _needs_hub(spec) and hub.unreachable() is not None
    try:
        with _hub_offline(offline):
            return manager.load([spec])
    except hub_errors() as e:  # datasets' and huggingface_hub's: not found, offline, bad config, ...
        reason = f"; {hub.reason}" if offline else ""
        hint = " (offline?)" if _needs_hub(spec) else ""  # a local file that is missing: the error names it
        return f"dataset could not be loaded{hint}: {_first_line(e)}{reason}"


def _scoring_failure(e: BaseException, window: int) -> str:
    """One line for a task lm-eval could not score. lm-eval checks its requests with bare
    ``assert``s (an empty context or continuation -- e.g. a token spanning the join of the
    two --, or a continuation longer than the model's window): those are named."""
    msg = f"could not be scored: {_first_line(e)}"
    if isinstance(e, AssertionError):
        msg += (" (lm-eval rejected a request: an empty context or continuation, e.g. a token spanning their "
                f"join, or a continuation longer than the model's window of {window} tokens)")
    return msg


def _metrics_of(results: dict, task: str) -> dict[str, float]:
    """{metric: value} of one task in simple_evaluate's results ("acc,none" -> "acc"), floats only."""
    out = {}
    for key, value in (results.get("results", {}).get(task) or {}).items():
        if key in ("alias", "sample_len", "samples") or "_stderr" in key:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        metric, _, filt = key.partition(",")
        name = metric if filt in ("", "none") else f"{metric},{filt}"
        out[name] = float(value)
    return out


def check_tasks(task_names: list[str], task_dir: str | Path | None = None, verbose: bool = False) -> _Tasks:
    """Find each of ``task_names`` (as :func:`evaluate_tasks` does) before a model is loaded:
    ``keel eval`` refuses a bad ``--task-dir`` or task name at once. Returns the task index,
    for :func:`run_tasks` / :func:`evaluate_tasks` (``index=``: the registry is indexed once).

    Raises:
        KeelError: lm_eval is not installed, ``task_dir`` is not a folder, or a name is found
            nowhere (the first such name, in one line).
    """
    with contextlib.nullcontext() if verbose else _quiet_lm_eval():
        index = _Tasks(task_dir)
        for name in task_names:
            why = index.unknown(name)
            if why is not None:
                raise KeelError(f"task {name}: {why}")
    return index


def evaluate_tasks(model, tokenizer, task_names: list[str], limit: int | float | None = None,
                   task_dir: str | Path | None = None, batch_size: int = 1,
                   verbose: bool = False, index: _Tasks | None = None) -> dict[str, dict[str, Any]]:
    """Score a Hugging Face causal LM on lm-eval tasks, one task at a time.

    Args:
        model: a ``transformers.PreTrainedModel`` (here :class:`keel.hf.KeelForCausalLM`), on
            its device; it is put in eval mode (lm-eval does so) and not moved.
        tokenizer: its ``PreTrainedTokenizerFast``.
        task_names: lm-eval task names (see the module docstring for where they are found).
        limit: at most this many documents per task (an int), or a fraction if < 1; None = all.
        task_dir: extra folder of task YAMLs.
        batch_size: requests per forward pass (lm-eval's HFLM batch size).
        verbose: show lm-eval's and datasets' progress bars and info logs (default: silenced).
        index: the task index :func:`check_tasks` returned (default: built here from ``task_dir``).
    Returns:
        ``{task: {metric: value}}`` (e.g. ``acc``, ``acc_norm``, ``word_perplexity``,
        ``bits_per_byte``; lm-eval's definitions); a task that could not run maps to
        ``{"error": "<one line>"}`` instead, and that line is logged as a warning
        (``task X: <one line>``, logger ``keel.eval.tasks``).
    Raises:
        KeelError: lm_eval is not installed, or ``task_dir`` is not a folder.
    """
    try:
        from lm_eval import simple_evaluate  # optional extra [eval]: keel train imports this module without it
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        raise _needs_lm_eval(e) from None
    out: dict[str, dict[str, Any]] = {}
    hub = _HubProbe()
    quiet_logs = contextlib.nullcontext() if verbose else _quiet_lm_eval()
    with quiet_logs, _no_progress_bars(not verbose), _no_env_probe(), _keep_rng_state():
        index = index if index is not None else _Tasks(task_dir)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                  max_length=int(model.config.max_position_embeddings))
        for name in task_names:
            msg = index.unknown(name)
            if msg is not None:
                log.warning(f"task {name}: {msg}")
                out[name] = {"error": msg}
                continue
            manager = index.manager_for(name)
            loaded = _load_task(manager, index.spec(manager, name), hub)
            if isinstance(loaded, str):
                log.warning(f"task {name}: {loaded}")
                out[name] = {"error": loaded}
                continue
            tasks = list(loaded["tasks"].values()) + list(loaded.get("groups", {}).values())
            try:
                results = simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager,
                                          log_samples=False, bootstrap_iters=0, verbosity=None)
            except Exception as e:  # noqa: BLE001 -- one task's bad request must not stop the other tasks
                msg = _scoring_failure(e, int(lm.max_length))
                log.warning(f"task {name}: {msg}")
                out[name] = {"error": msg}
                continue
            for task in loaded["tasks"]:
                out[task] = _metrics_of(results, task)
    return out


def run_tasks(model, tokenizer, task_names: list[str], limit: int | float | None = None,
              task_dir: str | Path | None = None, batch_size: int = 1, verbose: bool = False,
              index: _Tasks | None = None) -> dict:
    """Score a native keel model on lm-eval tasks; the trainer's periodic evaluation.

    Args:
        model: :class:`keel.model.Transformer` (not copied: it is wrapped by
            :meth:`keel.hf.KeelForCausalLM.from_native`, so it stays on its device); its
            train/eval mode is restored afterwards.
        tokenizer: its ``tokenizers.Tokenizer`` (the run's tokenizer.json).
        task_names: task names; the shipped examples (``keel_python_completion``,
            ``keel_python_paragraphs``) need no ``task_dir``.
        limit: documents per task (None = all).
        task_dir, batch_size, verbose, index: as in :func:`evaluate_tasks`.
    Returns:
        ``{task: {metric: value}}``, ``{"error": ...}`` for a task that could not run
        (see :func:`evaluate_tasks`); metric values are finite floats or None (JSON-safe).
    """
    try:
        # lazy: keel.hf needs transformers (extra [eval]) and ~1.7 s; keel train imports this module
        from keel.hf.convert import wrap_native
    except ImportError as e:
        raise KeelError(f"task evaluation needs transformers and lm-eval: pip install -e .[eval] ({_first_line(e)})"
                        ) from None

    model = getattr(model, "_orig_mod", model)  # torch.compile
    model = getattr(model, "module", model)  # DistributedDataParallel
    was_training = model.training
    try:
        hf, hf_tok = wrap_native(model, tokenizer)
        res = evaluate_tasks(hf, hf_tok, task_names, limit=limit, task_dir=task_dir, batch_size=batch_size,
                             verbose=verbose, index=index)
    finally:
        model.train(was_training)
    return {t: {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in m.items()}
            for t, m in res.items()}


class TaskEvalCallback(Callback):
    """Every ``every`` steps, scores the model on lm-eval ``tasks`` (at most ``limit``
    documents each) and writes ``eval_tasks`` ({task: {metric: value}}) into the step's
    record. Collective under FSDP (the full model is gathered on rank 0).

    Raises (on construction, before anything trains): KeelError as :func:`check_tasks`: lm-eval is
    missing or a task name is found nowhere (it was a warning at every evaluation)."""

    config_keys = ("train.eval_tasks",)

    def __init__(self, tasks: list[str], every: int, limit: int | None):
        self.tasks, self.every, self.limit = tasks, every, limit
        self.index = check_tasks(tasks) if tasks and every else None

    def on_step_end(self, state: StepState) -> dict | None:
        if not (self.tasks and self.every and state.step % self.every == 0):
            return None
        plain = state.plain_model()
        out = None
        if plain is not None:
            out = {"eval_tasks": run_tasks(plain, state.tokenizer, self.tasks, limit=self.limit, index=self.index)}
        barrier(state.dist)
        return out
