"""Atomic output: write beside the target, then ``os.replace`` into place -- files
(:func:`atomic_path`, :func:`atomic_write_text`) and folders (:func:`atomic_dir`); a full
disk or a read-only folder as one line (:func:`disk_errors`); one writer per run directory
(:class:`RunLock`).

A reader (or a crash) never sees a half-written file: either the old content or the new.
Files get the usual permissions (0666 minus the umask), not ``mkstemp``'s 0600.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import resource
import shutil
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator

from keel.errors import KeelError
from keel.rundir import RunDir

_log = logging.getLogger(__name__)

# The signals that stop a run cleanly (finish the step, checkpoint, exit 128 + signal with a resume
# hint): Ctrl-C, kill / a scheduler's stop, SIGHUP (the terminal went away: a closed SSH session;
# exit 129), SIGUSR1, Slurm's pre-timeout warning by convention (``sbatch --signal=USR1@90``, as
# Lightning uses it), and SIGUSR2, the one submitit asks Slurm for (``--signal=USR2@90``; in a
# submitit job keel checkpoints first, then submitit requeues the job: :mod:`keel.experiments.executor`).
# One list for the trainer, the grid workers and the launchers that pass signals on.
# SIGQUIT (Ctrl-\) is deliberately not among them: it keeps its default, "quit now" (with a core
# dump where enabled), the one way to stop at once without waiting for the step; the last checkpoint,
# written atomically, stays intact and ``--resume`` continues from it.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def silence_hung_up_terminal(signum: int) -> None:
    """After SIGHUP (the controlling terminal hung up: an SSH session closed), point this
    process's standard output and error at ``/dev/null`` where they are a terminal, as ``nohup``
    does: every write to a hung-up terminal fails (EIO), which would end a run on its next
    progress line instead of at its checkpoint. Other signals, and output to a file or a pipe,
    are left alone."""
    if signum != signal.SIGHUP:
        return
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            # a hung-up terminal is no longer a tty to os.isatty (tcgetattr fails with EIO): any
            # character device but /dev/null itself is taken for one
            mode, rdev = os.fstat(fd).st_mode, os.fstat(fd).st_rdev
            if stat.S_ISCHR(mode) and rdev != os.stat(os.devnull).st_rdev:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was.
    ``suffix`` lets writers that infer the format from the name (matplotlib) see it.

    Raises:
        KeelError: the write (in the block too) failed for want of space or permission
            (:func:`disk_errors`): one line naming ``path``, not the temporary file.
    """
    path = Path(path)
    with disk_errors(path, own_path=True):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
        os.close(fd)
        try:
            yield Path(tmp)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)


def _name_max(path: Path) -> int:
    """The longest file name (bytes) the file system of ``path``'s nearest existing folder takes (255 if unknown)."""
    for folder in (path, *path.parents):
        with contextlib.suppress(OSError, ValueError):
            if folder.is_dir():
                return os.pathconf(folder, "PC_NAME_MAX")
    return 255


def check_path_names(path: str | os.PathLike, flag: str, room: int = 0) -> None:
    """Raise KeelError, one line, when a name in ``path`` is longer than its file system takes
    (``NAME_MAX``, 255 bytes on most), counting ``room`` more bytes for the last one (a
    temporary sibling keel writes first: ``.NAME.XXXXXXXX.tmp`` needs 14, ``NAME.tmp-PID`` 12),
    or the whole path is longer than ``PATH_MAX``. The OS's "File name too long" (ENAMETOOLONG)
    was a traceback, after the folders above the name had been made."""
    path = Path(path)
    limit = _name_max(path)
    parts = [p for p in path.parts if p != path.anchor]
    for i, part in enumerate(parts):
        n = len(os.fsencode(part))
        extra = room if i == len(parts) - 1 else 0
        if n + extra > limit:
            shown = part if len(part) <= 40 else f"{part[:20]}...{part[-8:]}"
            why = (f"the file system takes at most {limit} per name" if n > limit else
                   f"keel first writes a temporary name {extra} bytes longer beside it, and the file system takes "
                   f"at most {limit} per name")
            raise KeelError(f"{flag}: the name {shown!r} is {n} bytes long; {why}: choose a shorter one")
    if len(os.fsencode(os.path.abspath(path))) >= 4096:  # Linux's PATH_MAX
        raise KeelError(f"{flag}: the path is {len(os.fsencode(os.path.abspath(path)))} bytes long; the file system "
                        "takes at most 4095: choose a shorter one")


HF_TOKENIZER = "tokenizer.json"  # a Hugging Face model folder's tokenizer (transformers' name; a keel run's: RunDir)


def load_hf_tokenizer(folder: str | os.PathLike):
    """The fast tokenizer of a Hugging Face model folder (``transformers.AutoTokenizer``), for ``keel import-hf``,
    ``eval --hf`` and ``ablate --hf``.

    Raises:
        KeelError: one line naming ``folder``: no ``tokenizer.json`` there (keel needs a fast tokenizer), or
            transformers' (multi-line) message for one it cannot load, on one line.
    """
    from transformers import AutoTokenizer  # the optional extra [hf]; ~1.7 s to import: only where it is needed

    folder = Path(folder)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (ValueError, OSError) as e:
        if not (folder / HF_TOKENIZER).is_file():
            raise KeelError(f"cannot load the tokenizer of {folder}: no {HF_TOKENIZER} there (keel needs a fast "
                            "tokenizer): copy it there, or export the run again") from None
        raise KeelError(f"cannot load the tokenizer of {folder}: {' '.join(str(e).split())}") from None


@contextlib.contextmanager
def weights_load_errors(folder: str | os.PathLike) -> Iterator[None]:
    """Turn a failure to read a Hugging Face folder's weights inside the block (transformers'
    OSError for a missing ``model.safetensors``, safetensors' ``SafetensorError`` for a truncated or
    overwritten one) into one line naming ``folder``: ``keel import-hf``, ``eval --hf`` and
    ``ablate --hf`` printed their tracebacks.

    Raises:
        KeelError: as above; other errors pass through.
    """
    try:
        yield
    except KeelError:
        raise
    except Exception as e:  # noqa: BLE001 -- OSError, SafetensorError (safetensors' own class, by name)
        if not (isinstance(e, OSError) or type(e).__name__ == "SafetensorError"):
            raise
        folder = Path(folder)
        if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
            raise KeelError(f"{folder} holds no model weights (no model.safetensors): copy them there, or "
                            "export the run again") from None
        text = str(e).strip()
        first = text.splitlines()[0][:200] if text else type(e).__name__
        raise KeelError(f"cannot read the model weights in {folder} (truncated or damaged?): {first}") from None


def special_file_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it is there but is neither a regular file nor a folder (symbolic
    links followed): ``"a FIFO (named pipe)"``, ``"a character device"`` (``/dev/zero``),
    ``"a block device"``, ``"a socket"``, or ``"a broken symbolic link"``; None for a regular
    file, a folder or nothing at all. Reading such a file blocks for ever (a FIFO with no writer)
    or never ends (``/dev/zero``), so keel names it instead of opening it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.islink(path) else None
    except OSError:
        return None  # unreadable, a loop of links, a name too long: the caller's open() says so
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def check_regular_file(path: str | os.PathLike, what: str) -> None:
    """Raise KeelError ``"WHAT PATH is not a regular file (a FIFO (named pipe))"`` when ``path``
    is a special file (:func:`special_file_kind`); anything else passes (a missing file is the
    caller's to report)."""
    kind = special_file_kind(path)
    if kind is not None:
        raise KeelError(f"{what} {path} is not a regular file ({kind})")


def chmod_default(path: str | os.PathLike) -> None:
    """Give ``path`` the usual file permissions (0666 minus the umask): for files written by
    libraries that create them 0600 (safetensors' ``save_file``)."""
    os.chmod(path, 0o666 & ~_umask())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def make_temp_dir(parent: str | os.PathLike, name: str) -> Path:
    """A fresh folder ``parent/.name.XXXX.tmp`` with normal permissions (0777 minus umask),
    to be filled and then renamed into place with ``os.replace``.

    Raises:
        KeelError: ``parent`` holds no folders (``/proc``: ENOENT) or is gone; OSError otherwise.
    """
    try:
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".tmp"))
    except FileNotFoundError as e:
        raise KeelError(f"cannot make a folder in {parent}: {e.strerror}") from None
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: bool | Callable[[Path], object] = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path`` (:func:`make_temp_dir`); when the block
    succeeds it is renamed to ``path``. An existing ``path`` is removed first when
    ``replace`` (a function: ``replace(path)`` removes it, e.g. only the files keel wrote there;
    ``True``: the whole folder), else it must be an empty folder. On an exception the temporary
    folder is removed and ``path`` is left as it was.

    Raises:
        OSError: ``path`` exists, is not empty and ``replace`` is False.
        KeelError: a write failed for want of space or permission (:func:`disk_errors`),
            naming ``path``.
    """
    path = Path(path)
    with disk_errors(path, own_path=True):
        tmp = make_temp_dir(path.parent, path.name)
        try:
            yield tmp
            if path.exists() and callable(replace):
                replace(path)
            elif path.exists() and replace:
                shutil.rmtree(path)
            elif path.exists():
                path.rmdir()  # only an empty folder may be replaced
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_files(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder inside ``folder`` (created); the files written into it are
    moved into ``folder`` (replacing files of the same names) only when the whole block
    succeeds: a set of outputs (a table, its JSON, its plot) appears completely or not at all.

    Raises:
        KeelError: a write failed for want of space or permission (:func:`disk_errors`),
            naming ``folder``; nothing of the set is left.
    """
    created = [d for d in (Path(folder), *Path(folder).parents) if not d.exists()]  # deepest first
    folder = make_dirs(folder)
    done = False
    try:
        with disk_errors(folder, own_path=True):
            tmp = make_temp_dir(folder, "outputs")
            try:
                yield tmp
                for f in sorted(tmp.iterdir()):
                    os.replace(f, folder / f.name)
                done = True
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if not done:  # none of the folders this call made is left behind (empty ones only)
            remove_empty_dirs(created)


def remove_empty_dirs(folders: Iterable[Path]) -> None:
    """Remove each of ``folders`` (deepest first) while it is empty; stop at the first that is not."""
    for d in folders:
        try:
            d.rmdir()
        except OSError:
            return


# errno values of a write that failed because of the disk or the mount, not the program:
# full, over quota, read-only, not permitted, file too large.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                         errno.EEXIST, errno.ENOTDIR, errno.EISDIR})  # the last three: a file where a folder must be
_WHY = {errno.EEXIST: "a file is there, not a folder"}


def write_failure(e: BaseException | None) -> OSError | None:
    """The ``OSError`` with one of :data:`DISK_ERRNOS` behind ``e`` (``e`` itself or an error
    it was raised from or while handling: ``torch.save`` to a file object turns ENOSPC into a
    ``RuntimeError`` raised while handling it), or None when ``e`` is not such a failure."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e
        rust = re.search(r"\(os error (\d+)\)", str(e))  # safetensors' SafetensorError: "... (os error 28)"
        if rust and int(rust.group(1)) in DISK_ERRNOS:
            return OSError(int(rust.group(1)), os.strerror(int(rust.group(1))))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike, note: str = "", own_path: bool = False) -> Iterator[None]:
    """Turn a write that fails for want of space or permission, or because a file stands where a
    folder must be (:func:`write_failure`), inside the block into one line:
    ``KeelError("cannot write PATH: No space left on device{note}")``.
    ``PATH`` is the file the OS names, else ``path`` (always ``path`` with ``own_path``: the
    OS names a temporary file that the user never asked for). Other errors pass through.

    A failure already turned into that line by an inner block (an atomic writer inside) keeps
    its path; this block adds its ``note``.

    Raises:
        KeelError: as above.
    """
    try:
        yield
    except KeelError as e:
        if getattr(e, "disk_write", None) is None or not (note or own_path):
            raise
        where, why = (path if own_path else e.disk_write[0]), e.disk_write[1]
        raise _disk_error(where, why, note) from None
    except Exception as e:  # noqa: BLE001 -- OSError, torch's RuntimeError, SafetensorError: see write_failure
        cause = write_failure(e)
        if cause is None:
            raise
        where = path if own_path else cause.filename or path
        raise _disk_error(where, _WHY.get(cause.errno) or cause.strerror or os.strerror(cause.errno), note) from None


def _disk_error(where, why: str, note: str) -> KeelError:
    """``KeelError("cannot write WHERE: WHY{note}")``, its ``disk_write`` = (where, why) for an
    enclosing :func:`disk_errors` (which may name its own path or add its note)."""
    err = KeelError(f"cannot write {where}: {why}{note}")
    err.disk_write = (where, why)
    return err


def make_dirs(path: str | os.PathLike, name: str | os.PathLike | None = None) -> Path:
    """``mkdir -p path``; returns it as a Path.

    Raises:
        KeelError: one line naming the path (or ``name``, the folder the user asked for when
            ``path`` is a temporary one) when it cannot be a folder (a file stands there or in its
            parents; a parent that holds no folders, as ``/proc``) or cannot be written
            (:func:`disk_errors`).
    """
    path = Path(path)
    with disk_errors(name or path, own_path=name is not None):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileNotFoundError as e:  # a parent that refuses folders (/proc) or vanished meanwhile
            raise KeelError(f"cannot make the folder {name or path}: {e.strerror}") from None
    return path


LOCK_NAME = RunDir.LOCK

# What keel itself may find in a run folder it did not yet write a run into: its lock file, a grid
# job's job.json / run.log (the grid writes them before the run starts: RunDir.SETUP_FILES), and its
# own temporaries (``.NAME.XXXXXXXX.tmp``: :func:`atomic_path`, :func:`make_temp_dir`, with tempfile's random part).
KEEL_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]+\.tmp$")
# The log files a job scheduler writes into the folder a job is started in, before keel runs:
# Slurm's default ``slurm-%j.out`` (``slurm-%A_%a.out`` for an array job) and a ``slurm-%j.err``.
SCHEDULER_LOG = re.compile(r"^slurm-[A-Za-z0-9_.%-]+\.(out|err)$")


def foreign_entries(folder: str | os.PathLike) -> list[str] | None:
    """What keel did not write among the entries of run folder ``folder``: None when ``folder`` is
    a keel run (it holds a ``config.toml`` keel wrote); else the names of its entries other than
    keel's lock file, a grid job's ``job.json`` / ``run.log``, keel's temporaries and a job
    scheduler's log files (:data:`SCHEDULER_LOG`: Slurm writes ``slurm-%j.out`` into the folder a
    job starts in), sorted ([] for a new or empty folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    if RunDir(folder).is_run():
        return None
    return sorted(p.name for p in folder.iterdir() if not (
        p.name in RunDir.SETUP_FILES or KEEL_TEMPORARY.match(p.name) or SCHEDULER_LOG.match(p.name)))


def enclosing_run_checkpoints(path: str | os.PathLike) -> Path | None:
    """The ``checkpoints`` folder of a keel run that ``path`` is (or lies inside), or None. Keel
    deletes old checkpoints there, so no output of keel's may go there. Symbolic links are
    followed: ``path`` is checked as written and with its nearest existing ancestor resolved
    (``L/new`` after ``ln -s RUN/checkpoints L`` lies inside ``RUN/checkpoints``)."""
    path = Path(os.path.abspath(path))
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    candidates = [path]
    with contextlib.suppress(OSError, RuntimeError):  # a symlink loop: checked as written
        if existing is not None and (resolved := existing.resolve() / path.relative_to(existing)) != path:
            candidates.append(resolved)
    for candidate in candidates:
        for folder in (candidate, *candidate.parents):
            run = RunDir(folder.parent)
            if folder.name == RunDir.CHECKPOINTS and (run.is_run() or run.lock.is_file()):
                return folder
    return None


def check_output_not_in_checkpoints(path: str | os.PathLike, flag: str) -> None:
    """Raise KeelError when ``path`` is or lies inside a keel run's ``checkpoints`` folder
    (:func:`enclosing_run_checkpoints`): the run's checkpoint pruning would delete it later."""
    inside = enclosing_run_checkpoints(path)
    if inside is not None:
        raise KeelError(f"{flag} {path} lies inside the checkpoints folder of the run {inside.parent}, where keel "
                        "deletes old checkpoints; choose a folder outside it")


def check_run_folder(folder: str | os.PathLike, flag: str = "--run-dir") -> None:
    """Refuse to write a run into ``folder`` unless it is new, empty or a keel run (it holds the
    ``config.toml`` keel writes first, :func:`foreign_entries`); a folder whose only other files
    are a job scheduler's logs (Slurm's ``slurm-%j.out`` / ``.err``, written there before keel
    starts) counts as empty. Keel deletes only what it wrote: a folder of another tool's files
    (checkpoints, metrics.jsonl) or a home folder is never a run folder.

    Raises:
        KeelError: ``folder`` is a file, lies in a run's checkpoints folder, or holds files keel did not write.
    """
    folder = Path(folder)
    check_path_names(folder, flag)
    if folder.exists() and not folder.is_dir():
        raise KeelError(f"cannot write {folder}: a file is there, not a folder")
    check_output_not_in_checkpoints(folder, flag)
    foreign = foreign_entries(folder)
    if foreign:
        raise KeelError(f"{flag} {folder} is not a keel run (no config.toml written by keel) and not empty "
                        f"(it holds {_shown(foreign)}); keel writes a run only into a new or empty folder or a keel run: "
                        f"give another {flag}")


def _shown(names: list[str]) -> str:
    """``"a, b, c, d and 3 more"``: the first four of ``names``."""
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_output_folder(folder: str | os.PathLike, flag: str, own: Callable[[Path], bool], what: str) -> None:
    """Refuse to write ``what`` (e.g. "an ablation") into output folder ``folder`` unless it is new,
    empty, or holds only entries ``own(path)`` recognises as what keel wrote there before (and keel's
    temporaries, :data:`KEEL_TEMPORARY`): keel overwrites only its own outputs, never the user's
    files of the same names, and mixes none into a folder of other files. Checked before the work.

    Raises:
        KeelError: one line naming ``flag``, ``folder`` and the foreign entries; ``folder`` is a file
            or lies in a run's checkpoints folder (:func:`check_output_not_in_checkpoints`).
    """
    folder = Path(folder)
    check_path_names(folder, flag)
    if os.path.lexists(folder) and not folder.is_dir():
        raise KeelError(f"cannot write {folder}: a file is there, not a folder")
    check_output_not_in_checkpoints(folder, flag)
    foreign = sorted(p.name for p in folder.iterdir()
                     if not (KEEL_TEMPORARY.match(p.name) or own(p))) if folder.is_dir() else []
    if foreign:
        raise KeelError(f"{flag} {folder} holds {_shown(foreign)}, which keel did not write; keel writes {what} only "
                        f"into a new or empty folder or one holding only {what} keel wrote: move them, or give "
                        f"another {flag}")


class RunLock:
    """An exclusive lock on a run directory: ``fcntl.flock`` on ``DIR/.keel.lock``, which
    holds the pid of the process that has it. The OS drops the lock when that process
    exits, however it exits (``kill -9`` included), so a lock is never stale; the file
    itself may stay. A folder the lock created and nothing else wrote into (a run that failed
    or was stopped before writing anything) is removed again by :meth:`release`.

    ``name``: the lock file's name in ``folder``. ``transient``: the lock file goes again on
    release (a lock beside an output rather than in it, e.g. ``keel prepare``'s on
    ``PARENT/.OUT.keel.lock``: the dataset folder itself is replaced by a rename); a process that
    then locked the removed file sees it is gone and locks the new one. ``wait``: another holder is
    waited for (logged: :attr:`waiting`) instead of refused.

    Raises (from :meth:`acquire`):
        KeelError: another process holds the lock (the message names its pid; not with ``wait``),
            or the folder cannot be created or written (:func:`disk_errors`), or takes no new file
            (:attr:`unmakeable`, e.g. under /proc).
    """

    def __init__(self, folder: str | os.PathLike, name: str = LOCK_NAME, transient: bool = False,
                 wait: bool = False):
        self.folder = Path(folder)
        self.path = self.folder / name
        self.transient, self.wait = transient, wait
        self.fd: int | None = None
        self.created: list[Path] = []  # the folders acquire() made, deepest first
        # the refusal when another process holds it ({pid}: the holder's)
        self.busy = (f"run directory {self.folder} is in use by another keel process (pid {{pid}}); "
                     "wait for it to finish or stop it first")
        self.waiting = f"waiting for keel process {{pid}}, which holds {self.path}"  # logged with wait=True
        # the refusal when the folder exists but takes no new file (/proc, sysfs: ENOENT); {why}: the OS's words
        self.unmakeable = f"cannot make a file in {self.folder}: {{why}}"

    def acquire(self) -> "RunLock":
        """Take the lock (see the class); returns self."""
        self.created = [p for p in (self.folder, *self.folder.parents) if not p.exists()]  # deepest first
        make_dirs(self.folder)
        fd = self._locked_fd()
        while self.transient and not _same_file(fd, self.path):  # its holder removed it: lock the new file
            os.close(fd)
            fd = self._locked_fd()
        self.fd = fd
        try:
            with disk_errors(self.path):  # a full disk: was "cannot write the standard output" (no file named)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except KeelError:
            self.release()  # the folders it created go again
            raise
        return self

    def _locked_fd(self) -> int:
        """The lock file, open and locked by this process (waited for with :attr:`wait`)."""
        import fcntl  # POSIX-only: keel.io stays importable elsewhere

        with disk_errors(self.folder):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
            except FileNotFoundError as e:  # the folder is there (acquire made it), yet no file can be made in it
                raise KeelError(self.unmakeable.format(why=e.strerror)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            if not self.wait:
                os.close(fd)
                raise KeelError(self.busy.format(pid=holder)) from None
            _log.info(self.waiting.format(pid=holder))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:  # Ctrl-C while waiting
                os.close(fd)
                raise
        return fd

    def release(self) -> None:
        """Drop the lock (closing the file releases it); the lock file stays (a transient one
        goes, removed while still held), unless the lock created the folder and nothing else is
        in it: then the folder (and the parents the lock created) is removed, so a failed first
        start leaves nothing behind."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if self.transient:
                self.path.unlink()
            if self.created and [p.name for p in self.folder.iterdir()] in ([self.path.name], []):
                self.path.unlink(missing_ok=True)
                for folder in self.created:  # rmdir: only ever an empty folder
                    folder.rmdir()
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    """Whether open file ``fd`` is still the file at ``path`` (not removed or replaced)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def lock_holder(folder: str | os.PathLike) -> str | None:
    """The pid (as written in ``FOLDER/.keel.lock``) of the process that holds :class:`RunLock` on
    ``folder``, or None when no process holds it (no lock file, or its holder has exited). Probes
    with a shared non-blocking ``flock``, held for an instant."""
    import fcntl  # POSIX-only, as in RunLock.acquire

    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
    finally:
        os.close(fd)  # closing drops the probe's shared lock
    return None


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process ``signum`` when the thread that started it ends, even by
    ``kill -9`` (``prctl(PR_SET_PDEATHSIG)``), so no child is left working for a dead parent;
    a no-op elsewhere. Call it in the child (a pool initializer, a ``preexec_fn``)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signum))  # 1 = PR_SET_PDEATHSIG


@contextlib.contextmanager
def passing_on_stop_signals(pass_on: Callable[[int], None]) -> Iterator[list[int]]:
    """While the block runs, the :data:`STOP_SIGNALS` do not stop this process: each calls
    ``pass_on(signum)`` (e.g. send it to the child processes doing the work, which stop
    cleanly), and is appended to the list the block gets. The handlers are put back after.
    Signal handlers exist in the main thread only: elsewhere nothing is installed."""
    received: list[int] = []

    def handler(signum, frame) -> None:
        received.append(signum)
        silence_hung_up_terminal(signum)
        pass_on(signum)

    saved = {}
    if threading.current_thread() is threading.main_thread():
        saved = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, old in saved.items():
            signal.signal(s, old)


def pid_runs(pid: int | str) -> bool:
    """Does process ``pid`` (a number, or its text) exist and run? A zombie (ended but not yet waited
    for), a PID that is not a number, and one of another user's (no permission to signal it) do not."""
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, OverflowError):
        return False
    with contextlib.suppress(OSError):  # Linux: the state is the field after the command name
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def limit_failure(e: BaseException | None) -> str | None:
    """What a process limit that stopped an operation was, as words with the limit to raise, e.g.
    "Too many open files (the limit on open files, ulimit -n, is 12)", for ``e`` or an error it was
    raised from (EMFILE, ENFILE, EAGAIN, ENOMEM); None for any other error."""
    seen = 0
    while e is not None and seen < 10 and not (isinstance(e, OSError) and e.errno in _LIMIT_ERRNOS):
        e, seen = e.__cause__ or e.__context__, seen + 1
    if not isinstance(e, OSError) or e.errno not in _LIMIT_ERRNOS:
        return None
    why = e.strerror or os.strerror(e.errno)
    if e.errno == errno.EMFILE:
        why += f" (the limit on open files, ulimit -n, is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
    elif e.errno == errno.ENFILE:
        why += " (system-wide)"
    else:
        why += " (a limit on processes or memory: ulimit -u, ulimit -v)"
    return why


_LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)
