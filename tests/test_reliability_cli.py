"""Issue 11 through the command line: --restart, resumed-run messages, prepare's defaults
and output, folders created for --plot, the --device message, import-hf keeps the step."""

import json
import shutil

import pytest

from conftest import REPO, tiny_overrides
from keel.cli import main
from keel.config import load_config
from keel.experiments.presets import STRESS_OWNED


def sets(data, **train):
    return [a for s in tiny_overrides(data, **train) for a in ("--set", s)]


@pytest.fixture(scope="module")
def cli_run(tiny_data, tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", "--run-dir", str(run), *sets(tiny_data, steps=4, eval_every=2, checkpoint_every=2)]) == 0
    return run


def test_resume_of_a_finished_run_says_nothing_to_do(cli_run, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    out, err = capsys.readouterr()
    assert out == f"run: {run}\n"  # the nothing-to-do line was printed here as well as logged
    assert err.count("nothing to do") == 1 and f"{run} is already at step 4 (train.steps = 4): nothing to do" in err


def test_resumed_run_says_where_it_resumed(cli_run, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "train.steps=6"]) == 0
    out = capsys.readouterr().out
    assert "resumed at step 4, trained 2 more step(s)" in out and "validation loss at step 6" in out


def test_resume_with_fewer_steps_than_reached_is_one_line_and_writes_nothing(cli_run, tmp_path, capsys):
    """It wrote train.steps = 3 into a run at step 4 and `keel runs` showed "step 4/3"."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".keel.lock"}
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "train.steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"keel: error: cannot resume {run}: train.steps=3 is below the step this run reached (4); "
                   "give train.steps >= 4"]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".keel.lock"} == before


def test_restart_flag(cli_run, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    shutil.rmtree(run / "checkpoints")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no intact checkpoint" in err[0] and "--restart" in err[0]
    assert main(["train", "--resume", str(run), "--restart"]) == 0
    out = capsys.readouterr().out
    assert "validation loss at step 4" in out and "resumed" not in out


def test_run_dir_restart_trains_the_run_there_with_its_own_config(cli_run, tmp_path, capsys):
    """`keel train --run-dir DIR --restart` retrained DIR as the default demo (keel, width 128,
    bpe:8192), not the run that was there; --config still picks another config on purpose."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    before = load_config(run / "config.toml", stored=True)
    assert before.model.d_model != load_config(REPO / "keel" / "configs" / "demo.toml").model.d_model
    assert main(["train", "--run-dir", str(run), "--restart", "--set", "train.steps=2"]) == 0
    after = load_config(run / "config.toml", stored=True)
    assert after.model == before.model and after.data == before.data and after.train.steps == 2
    assert "validation loss at step 2" in capsys.readouterr().out


def test_prepare_defaults_match_the_demo_config(tmp_path, monkeypatch, capsys):
    """`keel prepare --source builtin:python-stdlib` built a second dataset (val_fraction 0.01 vs 0.05)."""
    from keel.cli import build_parser
    from keel.data.prepare import _canonical_inputs, dataset_slug

    args = build_parser().parse_args(["prepare", "--source", "builtin:python-stdlib"])
    d = load_config(REPO / "keel" / "configs" / "demo.toml").data
    cli = _canonical_inputs(args.source, args.tokenizer, args.val_fraction, args.max_bytes, None, args.text_field, 0)
    cfg = _canonical_inputs(d.source, d.tokenizer, d.val_fraction, d.max_bytes or None, None, d.text_field, 0)
    assert dataset_slug(cli) == dataset_slug(cfg) and args.cache_dir == d.cache_dir


def test_prepare_output_has_no_blank_lines_and_says_it_reuses(tmp_path, capsys, caplog):
    c = tmp_path / "c"
    c.mkdir()
    for i in range(3):
        (c / f"{i}.txt").write_text(f"document {i}\n" * 200)
    args = ["prepare", "--source", str(c), "--tokenizer", "bpe:300", "--out", str(tmp_path / "ds")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("dataset: ") and "\n\n" not in out and out.strip() == out.rstrip("\n")
    with caplog.at_level("INFO", logger="keel"):  # the CLI's log handler writes these to stderr
        assert main(args) == 0
    assert any(r.getMessage() == f"reusing cached dataset {tmp_path / 'ds'}" for r in caplog.records)


def test_prepare_out_over_a_dataset_of_other_inputs_is_one_line_and_force_replaces_it(tmp_path, capsys):
    """`keel prepare --out DIR` with another tokenizer replaced the dataset runs trained on, without a word."""
    c = tmp_path / "c"
    c.mkdir()
    for i in range(3):
        (c / f"{i}.txt").write_text(f"document {i}\n" * 200)
    args = ["prepare", "--source", str(c), "--out", str(tmp_path / "ds")]
    assert main([*args, "--tokenizer", "bpe:300"]) == 0
    meta = (tmp_path / "ds" / "meta.json").read_text()
    capsys.readouterr()
    assert main([*args, "--tokenizer", "bpe:280"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"keel: error: refusing to replace {tmp_path / 'ds'}: it holds a dataset prepared from "
                          "other inputs (tokenizer 'bpe:300' (now 'bpe:280'))") and len(err.strip().splitlines()) == 1
    assert (tmp_path / "ds" / "meta.json").read_text() == meta
    assert main([*args, "--tokenizer", "bpe:280", "--force"]) == 0
    assert json.loads((tmp_path / "ds" / "meta.json").read_text())["tokenizer"] == "bpe:280"


def test_generate_device_error_names_the_flag(cli_run, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert main(["generate", "--run", str(cli_run), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device is cuda but no CUDA device is available" in err and "train.device" not in err


def test_gradflow_plot_creates_its_folder(tiny_data, tmp_path, capsys):
    png = tmp_path / "new" / "dir" / "gf.png"
    code = main(["gradflow", "--residual", "keel", "--sublayers", "2", "--json", "--plot", str(png), "--d-model", "32",
                 "--seq-len", "16", "--batch-size", "2", "--threads", "1", "--jacobian-iters", "2",
                 "--set", f"data.path={tiny_data}"])
    assert code == 0, capsys.readouterr().err
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_import_hf_keeps_the_step(cli_run, tmp_path, capsys):
    pytest.importorskip("transformers")
    assert main(["export-hf", "--run", str(cli_run), "--out", str(tmp_path / "hf")]) == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"]  # was 0600
    assert main(["import-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert [p.name for p in (tmp_path / "back" / "checkpoints").glob("step_*")] == ["step_00000004"]
    # issue 12: the imported run resumes (fresh optimiser, LR schedule at step 4) and trains on
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "back"), "--set", "train.steps=8"]) == 0
    from keel.train.metrics import read_metrics

    records = read_metrics(tmp_path / "back" / "metrics.jsonl")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [5, 6, 7, 8]
    # the mean throughput counts the 4 steps this process timed, not the 4 imported ones too (was ~2x here,
    # 13-20x for a longer import): the CLI's line and `keel runs` agree
    from keel.experiments.overview import run_row
    from keel.run import Run

    last, per_step = records[-1], records[-1]["tokens"] // 8
    assert last["tokens"] == 8 * per_step
    expected = 4 * per_step / last["elapsed_s"]
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tokens:"))
    assert line == f"tokens: {last['tokens']:,}, mean {expected:,.0f} tokens/s"
    assert run_row(Run(tmp_path / "back"))["tokens_per_s"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("argv", [
    ["sweep", "--grid", "train.lr=1e-3"],
    ["sweep"],  # the bare resume docs/usage.md gives (the folder's own --grid): was "nothing to sweep: give --grid"
    ["stress", "--residual", "keel", "--sublayers", "2", "--seeds", "0", "--ramp-steps", "2"],
    ["lr-sensitivity", "--residual", "keel", "--sublayers", "2", "--lrs", "1e-3", "--seeds", "0"],
    ["study", "claims", "--scale", "tiny", "--groups", "showcase"],
])
def test_resume_of_a_folder_that_does_not_exist_is_refused(argv, tmp_path, tiny_data, capsys):
    """`--resume --out <typo>` started the whole grid again in a new folder (at a study's cpu scale,
    hours) instead of saying there was nothing to continue."""
    out = tmp_path / "no-such-folder"
    tiny = [] if argv[0] == "study" else sets(tiny_data, drop=STRESS_OWNED, steps=1, eval_every=1)
    assert main([*argv, *tiny, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {out} does not exist, nothing to continue" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("holds", ["nothing", "a study", "a train run"])
def test_a_bare_sweep_resume_of_a_folder_no_sweep_started_names_the_folder(holds, tmp_path, capsys):
    """`keel sweep --out DIR --resume` of a folder keel sweep did not start said "nothing to sweep: give --grid",
    as if the flag were missing, not the sweep; now it names the folder."""
    out = tmp_path / "dir"
    out.mkdir()
    if holds == "a study":
        (out / "study.json").write_text(json.dumps({"command": "keel study claims --scale tiny"}))
    elif holds == "a train run":
        (out / "config.toml").write_text("[model]\n")
    assert main(["sweep", "--out", str(out), "--resume"]) == 2
    assert capsys.readouterr().err == (f"keel: error: --resume: {out} was not started by keel sweep (its study.json "
                                       "records no keel sweep command), so there is no grid to continue; check "
                                       "--out, or give --grid\n")


@pytest.mark.parametrize("given, words", [
    (["data.tokenizer=bpe:9999"], "data.tokenizer = 'bpe:9999' (it has 'bpe:512')"),
    (["data.val_fraction=0.5", "data.source=/nonexistent"],
     "data.val_fraction = 0.5 (it has 0.05), data.source = '/nonexistent' (it has 'builtin:python-stdlib')"),
])
def test_a_data_key_set_beside_data_path_is_refused_not_dropped(tiny_data, tiny_reference_run, tmp_path, capsys,
                                                                given, words):
    """`--set data.tokenizer=bpe:9999` with data.path trained on the dataset's own bpe:512 without a word,
    on a new run and on a resume (where the README says data keys are refused)."""
    sets = [a for s in [*tiny_overrides(tiny_data), *given] for a in ("--set", s)]
    assert main(["train", *sets, "--run-dir", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
    err = capsys.readouterr().err
    assert err == (f"keel: error: {words}: not how data.path {tiny_data} was prepared, and with data.path the "
                   f"dataset's own settings apply; drop {', '.join(g.split('=')[0] for g in given)}, or `keel "
                   "prepare` a dataset with them and give its data.path\n")
    run = tmp_path / "run"
    shutil.copytree(tiny_reference_run, run)
    before = (run / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(run), *[a for g in given for a in ("--set", g)],
                 "--set", "train.steps=14"]) == 2
    assert words in capsys.readouterr().err and (run / "metrics.jsonl").read_text() == before
    same = main(["train", "--resume", str(run), "--set", "data.tokenizer=bpe:512", "--set", "train.steps=12"])
    assert same == 0  # the dataset's own value: nothing is dropped


def test_a_resume_on_a_dataset_with_a_larger_vocabulary_says_the_run_cannot_read_it(tiny_reference_run, tmp_path,
                                                                                     capsys):
    """Resuming a run (512 embedding rows) with --set data.path= a dataset of a 1024-id tokenizer said
    'model.vocab_size = 512 is smaller than the tokenizer's vocabulary; use "auto"', which a resume cannot change."""
    import shutil

    from keel.data import prepare_dataset

    run = tmp_path / "run"
    shutil.copytree(tiny_reference_run, run)
    big = prepare_dataset("builtin:python-stdlib", "bpe:1024", cache_dir=tmp_path / "data", max_bytes=120_000,
                          progress=False)
    capsys.readouterr()  # what preparing printed
    assert main(["train", "--resume", str(run), "--set", f"data.path={big}", "--set", "train.steps=16"]) == 2
    assert capsys.readouterr().err == (f"keel: error: cannot resume {run} on {big}: its tokenizer has 1024 ids, more "
                                       "than the run's 512 embedding rows (model.vocab_size); resume on the data the "
                                       "run was trained with, or start a new run\n")
