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
