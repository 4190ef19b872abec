"""A file standing where a command must create a folder (``--out``, ``--run-dir``, ``--plot``'s
folder) is a user mistake: one line naming the path, exit 2, no traceback (found by a
fresh-user trial: these printed a FileExistsError / NotADirectoryError traceback)."""

import pytest

from keel.cli import main

TINY = ["--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "train.steps=1"]


@pytest.mark.parametrize("argv,where", [
    (["train", *TINY, "--run-dir", "{f}"], "{f}"),
    (["train", *TINY, "--run-dir", "{f}/run"], "{f}/run"),
    (["stress", "--sublayers", "4", "--out", "{f}", "--report-only"], "{f}"),
    (["lr-sensitivity", "--out", "{f}", "--report-only"], "{f}"),
    (["study", "claims", "--scale", "tiny", "--out", "{f}/x"], "{f}/x"),
])
def test_a_file_where_a_folder_must_be(tmp_path, capsys, argv, where):
    f = tmp_path / "a-file"
    f.write_text("not a folder")
    rc = main([a.format(f=f) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith(f"keel: error: cannot write {where.format(f=f)}: ")
    assert not any("Traceback" in line for line in err)
    assert f.read_text() == "not a folder"


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs /proc, a folder that holds no new folders")
@pytest.mark.parametrize("argv", [
    ["train", *TINY, "--run-dir", "/proc/keel-run"],
    ["sweep", "--grid", "train.seed=0,1", *TINY, "--out", "/proc/keel-run"],
    ["prepare", "--out", "/proc/keel-run"],
])
def test_a_folder_that_cannot_be_made_is_one_line(capsys, argv):
    """mkdir under /proc fails with ENOENT (not a disk error): a FileNotFoundError traceback from the
    run lock, the sweep folder and the dataset's temporary folder (found by a new-user trial)."""
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == "keel: error: cannot make the folder /proc/keel-run: No such file or directory"
    assert not any("Traceback" in line for line in err)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs /proc, a folder that holds no new folders")
def test_export_hf_into_a_folder_that_holds_no_folders_is_one_line(tiny_reference_run, keel_main):
    """export-hf's temporary folder beside --out: mkdtemp under /proc raised FileNotFoundError (a traceback)."""
    r = keel_main("export-hf", "--run", tiny_reference_run, "--out", "/proc/keel-export")
    assert (r.returncode, r.stderr) == (2, "keel: error: cannot make a folder in /proc: No such file or directory\n")


SEED_RANGE = "must be between 0 and 2**32 - 1 (numpy's seed range), got"


@pytest.mark.parametrize("argv,error", [
    (["generate", "--seed", "99999999999999999999"], f"--seed {SEED_RANGE} 99999999999999999999"),
    (["generate", "--seed", "-1"], f"--seed {SEED_RANGE} -1"),
    (["generate", "--seed", str(2**32 - 1), "--num-samples", "2"],
     f"--seed + --num-samples - 1 (the last sample's seed) {SEED_RANGE} {2**32}"),
    (["generate", "--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["generate", "--temperature", "inf"], "--temperature must be a finite number >= 0 (0 = greedy), got inf"),
    (["gradflow", "--seed", "99999999999999999999"], f"--seed {SEED_RANGE} 99999999999999999999"),
])
def test_a_seed_or_temperature_out_of_range_is_one_line(argv, error, tiny_reference_run, keel_main):
    """A seed beyond 2**64 was an OverflowError traceback (torch's manual_seed), -1 was taken although
    keel train refuses it, and --temperature nan a RuntimeError traceback from sampling."""
    run = ["--run", tiny_reference_run] if argv[0] == "generate" else []
    r = keel_main(*argv, *run)
    assert (r.returncode, r.stderr, r.stdout) == (2, f"keel: error: {error}\n", "")


def test_a_run_with_relative_data_paths_is_scored_on_its_own_dataset_from_any_folder(tmp_path, keel_main, one_thread):
    """A run trained with a relative ``data.source`` and ``data.cache_dir`` stores them absolute:
    ``keel eval --run`` from another folder scores the run's own held-out text (before the fix it
    read ``corpus`` and ``cache`` from the current folder: another dataset, or an error)."""
    import shutil

    from keel.config import load_config
    from keel.data.sources import stdlib_files

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    for folder, files in ((here, stdlib_files()[:40]), (elsewhere, stdlib_files()[40:80])):
        (folder / "corpus").mkdir(parents=True)
        for f in files:  # "elsewhere" holds a corpus of the same name with other text
            shutil.copyfile(f, folder / "corpus" / f"{f.stem}.txt")
    sets = ["data.source=corpus", "data.cache_dir=cache", "data.tokenizer=bpe:512", "model.d_model=32",
            "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "train.seq_len=32", "train.batch_size=2",
            "train.steps=2", "train.eval_every=2", "train.eval_tokens=256", "train.sample_tokens=0", "train.progress=false"]
    trained = keel_main("train", *[a for s in sets for a in ("--set", s)], "--run-dir", "run", cwd=here)
    assert trained.returncode == 0, trained.stderr
    data = load_config(here / "run" / "config.toml", stored=True).data
    assert data.source == str((here / "corpus").resolve())
    assert data.cache_dir == str(here / "cache")

    scored = [keel_main("eval", "--run", here / "run", "--max-tokens", "256", cwd=cwd) for cwd in (here, elsewhere)]
    assert [r.returncode for r in scored] == [0, 0], [r.stderr for r in scored]
    lines = [next(ln for ln in r.stdout.splitlines() if ln.startswith("  loss")) for r in scored]
    assert lines[0] == lines[1]
    assert str(here / "cache") in scored[1].stdout
    assert not (elsewhere / "cache").exists()  # nothing prepared from the other folder's corpus


def test_a_run_that_stored_relative_data_paths_still_resumes(tmp_path, monkeypatch):
    """A checkpoint from before data paths were stored absolute holds ``data.source = "corpus"``;
    resumed from the folder it was started in, that is the same source as the absolute one the
    trainer now uses: no refusal, no change recorded."""
    from keel.config import Config
    from keel.errors import KeelError
    from keel.train.resume import check_config_changes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    old = Config().to_dict()
    old["data"].update(source="corpus", cache_dir="cache")
    new = Config()
    new.data.source, new.data.cache_dir = str(tmp_path / "corpus"), str(tmp_path / "cache")
    assert check_config_changes({"step": 1, "config": old}, new, tmp_path / "run") == {}
    new.data.source = str(tmp_path)  # another folder is still another source
    with pytest.raises(KeelError, match="data.source"):
        check_config_changes({"step": 1, "config": old}, new, tmp_path / "run")


def test_a_run_given_a_prepared_dataset_records_how_it_was_made(tiny_data, tmp_path, one_thread):
    """With data.path set, config.toml recorded the unread defaults (tokenizer = "bpe:8192" for a
    512-token dataset); it now records the dataset's meta.json, and a run that stored the
    defaults still resumes (how a given dataset was made is not compared)."""
    from conftest import REPO, tiny_overrides
    from keel.config import Config, load_config
    from keel.data import read_meta
    from keel.train import train
    from keel.train.resume import check_config_changes

    meta = read_meta(tiny_data)
    run = tmp_path / "run"
    train(load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(tiny_data, steps=2, eval_every=2)), run)
    data = load_config(run / "config.toml", stored=True).data
    assert (data.tokenizer, data.source, data.max_bytes, data.val_fraction, data.path) == (
        meta["tokenizer"], meta["source"], meta["max_bytes"] or 0, meta["val_fraction"], str(tiny_data))
    assert data.tokenizer != Config().data.tokenizer  # the fixture's is not the default: the test can fail
    stored = load_config(run / "config.toml", stored=True)
    old = stored.to_dict()  # an older run given the same dataset: the data defaults stored
    old["data"] = {**Config().to_dict()["data"], "path": str(tiny_data)}
    assert check_config_changes({"step": 1, "config": old}, stored, run) == {}


def test_a_dataset_prepared_again_with_another_tokenizer_is_refused(tiny_data, tmp_path, keel_main, one_thread):
    """`keel prepare --out` over a run's dataset with another tokenizer: `keel eval --run` scored the
    new ids with the old model (6.76 nats against the run's 3.43), without a word. The dataset's
    meta.json records its tokenizer's sha256; the run keeps its own tokenizer.json."""
    import hashlib
    import json
    import shutil

    from conftest import REPO, tiny_overrides
    from keel.config import load_config
    from keel.train import train

    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_data, data)
    train(load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(data, steps=2, eval_every=2)), run)
    assert keel_main("eval", "--run", run, "--max-tokens", "256").returncode == 0
    tok = json.loads((data / "tokenizer.json").read_text())  # another tokenizer: one merge fewer
    tok["model"]["merges"] = tok["model"]["merges"][:-1]
    (data / "tokenizer.json").write_text(json.dumps(tok))
    meta = json.loads((data / "meta.json").read_text())
    meta["tokenizer_sha256"] = hashlib.sha256((data / "tokenizer.json").read_bytes()).hexdigest()
    (data / "meta.json").write_text(json.dumps(meta))
    r = keel_main("eval", "--run", run, "--max-tokens", "256")
    assert r.returncode == 2 and r.stderr == (
        f"keel: error: {data} was prepared with another tokenizer than run {run}'s (their vocabularies or merges "
        "differ): its token ids are other text to this model; prepare the run's dataset again\n")
