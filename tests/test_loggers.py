"""Experiment tracking (keel.train.loggers) and quiet progress (keel.train.progress): TensorBoard
event files read back with tensorboard's EventAccumulator equal metrics.jsonl, resume continues
the same TensorBoard / W&B run without duplicate steps, W&B offline run folders, missing extras,
and the plain progress lines that replace tqdm when stderr is not a terminal."""

import logging
import re
import math
import sys

import pytest

from keel.config import load_config
from keel.errors import KeelError
from keel.train.loggers import check_loggers, config_hparams, flatten, open_sinks
from keel.train.metrics import read_metrics
from keel.train.progress import ProgressReporter, format_duration, format_percent


def test_flatten_joins_nested_names_and_drops_non_numbers():
    rec = {"step": 3, "loss": 2.5, "skipped": True, "divergence": "ok", "x": None,
           "eval_tasks": {"t": {"acc": 0.5}}, "sublayer_grad_norm": [1.0, 2.0]}
    assert flatten(rec) == {"step": 3.0, "loss": 2.5, "skipped": 1.0, "eval_tasks/t/acc": 0.5,
                            "sublayer_grad_norm/0": 1.0, "sublayer_grad_norm/1": 2.0}
    assert config_hparams({"train": {"loggers": ["jsonl", "wandb"], "lr": 0.1}}) == {
        "train.loggers": "jsonl,wandb", "train.lr": 0.1}


def test_logger_names_checked_and_config_accepts_list_or_string(tiny_config):
    assert check_loggers(["tensorboard"]) == ["jsonl", "tensorboard"]
    assert check_loggers("wandb, jsonl,wandb") == ["jsonl", "wandb"]
    with pytest.raises(KeelError, match=r"loggers must be a list of 'jsonl' \| 'tensorboard' \| 'wandb', got 'mlflow'"):
        check_loggers(["mlflow"])
    from conftest import REPO

    from keel.config import load_config

    for value in ('["jsonl","tensorboard"]', "jsonl,tensorboard"):
        cfg = load_config(REPO / "keel" / "configs" / "demo.toml", [f"train.loggers={value}"])
        assert cfg.train.loggers == ["jsonl", "tensorboard"]
    with pytest.raises(KeelError, match="train.loggers must be a list of strings"):
        load_config(None, ["train.loggers=3"])


def test_missing_optional_package_names_the_extra(tmp_path, monkeypatch, tiny_config):
    cfg = tiny_config()
    for name in ("tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # import of it raises ImportError
        cfg.train.loggers = ["jsonl", name]
        with pytest.raises(KeelError, match=rf"^train.loggers has '{name}' but {name} is not installed: "
                                            rf"pip install -e \.\[{name}\]$"):
            open_sinks(cfg, tmp_path)


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc, {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_equal_metrics_jsonl_and_resume_continues(tiny_config, tmp_path):
    pytest.importorskip("tensorboard")
    from keel.train import train

    run = tmp_path / "run"
    train(tiny_config(steps=2, eval_every=2, checkpoint_every=2, loggers='["tensorboard"]'), run)
    # resume to step 4 (a longer schedule): the same TensorBoard folder, steps 3 and 4 added
    train(tiny_config(steps=4, eval_every=2, checkpoint_every=2, loggers='["tensorboard"]'), run, resume=True)
    acc, scalars = _scalars(run / "tensorboard")
    records = read_metrics(run / "metrics.jsonl")
    expected: dict = {}
    for r in records:
        for name, value in flatten(r).items():
            if name != "step":
                expected.setdefault(name, []).append((r["step"], value))
    assert set(scalars) == set(expected) >= {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ppl"}
    for tag, points in expected.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag  # every step once, in order
        for (_, v), (_, want) in zip(got, points):
            assert v == pytest.approx(want, rel=1e-6), tag  # float32 in the event file
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4]
    # the resolved config as hyper-parameters and as text
    hp = acc.PluginTagToContent("hparams")
    assert hp and "_hparams_/session_start_info" in hp
    from tensorboard.plugins.hparams import plugin_data_pb2

    info = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/session_start_info"]).session_start_info
    assert info.hparams["model.d_model"].number_value == 32
    assert info.hparams["train.loggers"].string_value == "tensorboard"


def test_wandb_offline_writes_its_run_folder_and_resume_keeps_the_run(tiny_config, tmp_path):
    pytest.importorskip("wandb")
    from keel.train import train

    run = tmp_path / "run"
    train(tiny_config(steps=2, eval_every=2, checkpoint_every=2, loggers='["wandb"]'), run)
    run_id = (run / "wandb_id").read_text().strip()
    first = sorted((run / "wandb").glob("offline-run-*"))
    assert len(first) == 1 and f"-{run_id}" in first[0].name
    assert list(first[0].glob("*.wandb")) and (first[0] / "files").is_dir()
    train(tiny_config(steps=3, eval_every=3, checkpoint_every=3, loggers='["wandb"]'), run, resume=True)
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)  # one W&B run, synced as one
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "config_change" not in r] == [0, 1, 2, 3]
    assert [r["step"] for r in records if "config_change" in r] == [2]  # train.steps 2 -> 3, logged by all


def test_progress_lines_every_n_steps_or_m_seconds():
    t = [0.0]
    rep = ProgressReporter(total=20, initial=0, tokens_per_step=100, every_steps=5, every_s=7.0, use_bar=False,
                           clock=lambda: t[0])
    lines = {}
    for step in range(1, 21):
        t[0] += 2.0  # 2 s per step
        line = rep.update({"step": step, "loss": 1.0 / step, "lr": 1e-3, "tokens_per_s": 0.0})
        if line:
            lines[step] = line
    # every 5 steps, or once 7 s passed since the last line (step 9: 8 s after step 5), and the last step;
    # the seconds count from the end of step 1 (the first window), so step 4 is not due (6 s)
    assert sorted(lines) == [5, 9, 10, 14, 15, 19, 20]
    assert lines[5] == "step 5/20 (25%) | loss 0.2000 | lr 1.00e-03 | 50 tokens/s | ETA 30s"  # 100 tokens per 2 s
    assert lines[9] == "step 9/20 (45%) | loss 0.1111 | lr 1.00e-03 | 50 tokens/s | ETA 22s"
    assert lines[20].endswith("ETA 0s")
    assert format_duration(3725) == "1h02m" and format_duration(245) == "4m05s"


def test_progress_tokens_per_s_leaves_out_the_start_up():
    """A first step of 60 s (torch.compile, warm-up), then 2 s per step: the first line says how
    long that step took, and tokens/s and the ETA count only the steps after it (50 tokens/s, not
    4 x 100 tokens / 68 s = 6); the window starts at the first step of a resumed run too."""
    t = [0.0]
    rep = ProgressReporter(total=20, initial=10, tokens_per_step=100, every_steps=5, every_s=30.0, use_bar=False,
                           clock=lambda: t[0])
    lines = {}
    for step in range(11, 21):
        t[0] += 60.0 if step == 11 else 2.0
        line = rep.update({"step": step, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 100 / (60.0 if step == 11 else 2.0)})
        if line:
            lines[step] = line
    assert sorted(lines) == [11, 15, 20]  # step 11: 60 s > every_s
    assert lines[11] == "step 11/20 (55%) | loss 2.0000 | lr 1.00e-03 | first step 1m00s"
    assert lines[15] == "step 15/20 (75%) | loss 2.0000 | lr 1.00e-03 | 50 tokens/s | ETA 10s"
    assert lines[20] == "step 20/20 (100%) | loss 2.0000 | lr 1.00e-03 | 50 tokens/s | ETA 0s"


@pytest.mark.parametrize("mfu,shown", [(1e-4, "0.010%"), (1.1e-4, "0.011%"), (0.0123, "1.2%"), (0.4249, "42%"),
                                       (0.0996, "10%"), (1.0, "100%"), (2.5e-7, "0.000025%"), (0.0, "0%")])
def test_progress_mfu_has_two_significant_digits(mfu, shown):
    """A tiny CPU model's MFU (1e-4) was printed as 0.0%."""
    assert format_percent(mfu) == shown
    t = [0.0]
    rep = ProgressReporter(total=4, initial=0, tokens_per_step=10, every_steps=2, use_bar=False, clock=lambda: t[0])
    for step in (1, 2):
        t[0] += 1.0
        line = rep.update({"step": step, "loss": 1.0, "lr": 1e-3, "mfu": mfu})
    assert line == f"step 2/4 (50%) | loss 1.0000 | lr 1.00e-03 | 10 tokens/s | MFU {shown} | ETA 2s"


def test_training_logs_plain_progress_when_stderr_is_not_a_terminal(tiny_config, tmp_path, caplog, capsys):
    from keel.train import train

    with caplog.at_level(logging.INFO, logger="keel"):
        train(tiny_config(steps=4, eval_every=4, checkpoint_every=4, progress=True, log_every=2), tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if r.name == "keel.train.progress"]
    assert [ln.split(" (")[0] for ln in lines] == ["step 2/4", "step 4/4"]
    loss = read_metrics(tmp_path / "run" / "metrics.jsonl")[2]["loss"]
    assert f"loss {loss:.4f}" in lines[0] and "tokens/s" in lines[0] and "ETA" in lines[0]
    assert "\r" not in capsys.readouterr().err  # no progress bar
    assert math.isfinite(loss)


def test_mfu_is_logged_per_step_beside_tokens_per_s(tiny_config, tmp_path, caplog):
    """With a peak (train.peak_tflops), every step's record has MFU = tokens/s x model FLOPs per
    token (PaLM App. B) / peak, and the progress line shows it; on a CPU without one, none."""
    from keel.model import flops_per_token
    from keel.train import train

    cfg = tiny_config(steps=2, eval_every=2, checkpoint_every=2, progress=True, log_every=1, peak_tflops=0.5)
    with caplog.at_level(logging.INFO, logger="keel"):
        train(cfg, tmp_path / "run")
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    fpt = flops_per_token(load_config(tmp_path / "run" / "config.toml").model, cfg.train.seq_len)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / 0.5e12, rel=1e-12) and 0 < r["mfu"] < 1
    lines = [x.getMessage() for x in caplog.records if x.name == "keel.train.progress"]
    assert len(lines) == 2 and re.search(r"\| first step \d+s$", lines[0]), lines  # no throughput yet: no MFU
    assert f"tokens/s | MFU {format_percent(steps[1]['mfu'])} | ETA" in lines[1], lines
    train(tiny_config(steps=1, progress=False), tmp_path / "cpu")
    assert not any("mfu" in r for r in read_metrics(tmp_path / "cpu" / "metrics.jsonl"))


def test_wandb_does_not_log_a_step_twice_across_a_resume(tmp_path):
    """An interruption after step 5 but a checkpoint at step 3: the resumed run redoes steps 4
    and 5; W&B already has them (it cannot take steps back), so only 6 on is logged."""
    pytest.importorskip("wandb")
    from keel.train.loggers import WandbSink

    first = WandbSink(tmp_path, {"train": {"lr": 0.1}}, mode="offline")
    assert [first.write({"step": s, "loss": 1.0 / (s + 1)}) for s in range(6)] == [True] * 6
    first.close()
    again = WandbSink(tmp_path, {"train": {"lr": 0.1}}, mode="offline")
    assert [again.write({"step": s, "loss": 0.5}) for s in (4, 5, 6, 7)] == [False, False, True, True]
    assert again.write({"step": 3, "config_change": {"train.steps": {"old": 6, "new": 9}}})  # not a step's numbers
    again.close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    from conftest import wandb_rows

    held = [(int(r["step"]), r.get("loss"), r.get("config_change/train.steps/new")) for r in wandb_rows(tmp_path, 9)]
    assert held == [(s, 1.0 / (s + 1), None) for s in range(6)] + [(6, 0.5, None), (7, 0.5, None), (3, None, 9)]
    folders = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f"-{run_id}" in p.name for p in folders)  # one W&B run, two sessions
    with pytest.raises(KeelError, match="train.wandb_mode must be 'offline' \\| 'online' \\| 'disabled', got 'cloud'"):
        WandbSink(tmp_path, {}, mode="cloud")


def test_progress_bar_on_a_terminal_counts_steps_from_a_resumed_start():
    rep = ProgressReporter(total=10, initial=4, tokens_per_step=8, use_bar=True)
    assert rep.update({"step": 5, "loss": 2.0, "tokens_per_s": 100.0}) is None  # the bar, no line
    rep.update({"step": 6, "loss": 1.5, "tokens_per_s": 100.0})
    assert (rep.bar.n, rep.bar.total) == (6, 10)
    rep.close()
    quiet = ProgressReporter(total=10, initial=0, tokens_per_step=8, enabled=False, use_bar=False)
    assert quiet.update({"step": 10, "loss": 1.0}) is None and quiet.bar is None
