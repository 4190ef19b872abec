"""The code measures of issue 49 ("code we want to live in, v4"), printed for a source tree.

    python benchmarks/code_measures.py [ROOT]      # ROOT: a checkout of keel (default: this one)

What it counts (all from the AST, nothing imported from ROOT):

* **string-key reads of run records**: ``x["key"]`` and ``x.get("key")`` in ``keel/experiments``
  where ``key`` is a run record's field (``keel.experiments.record.RunRecord``: group, name,
  scheme, sublayers, seed, lr, status, capped_loss, ...) and ``x`` is a plain name (``r``,
  ``rec``, ``old`` ...), outside the modules that read and write records (``record.py``, ``job_result.py``).
  A proxy: a row dict with a ``"sublayers"`` key counts too. Also: every string-key read in
  ``keel/experiments`` and how many distinct keys (the issue's "890 reads, 173 keys").
* **record shapes**: the places that spell a run record's keys: a module-level tuple, list or
  dict of five or more string constants that are record fields (``RESTORED_KEYS``,
  ``_RECORD_CHECKS`` ...), and a dict literal with five or more such keys (``run_record``'s ``{...}``).
* **run-folder file names**: the files of ``keel/`` holding a string constant that names a file of
  a run folder (``config.toml``, ``metrics.jsonl``, ``result.json`` ...).
* **functions above cyclomatic complexity 20** (radon's rank C and worse; radon is not installed,
  so McCabe's count as radon makes it: 1 + if/elif/for/while/except/with/assert/comprehension
  (+ its ifs) + boolean operators (values - 1) + conditional expressions; nested functions
  counted on their own).
* **code lines of keel/experiments**: lines that are not blank, not comment-only, not docstring.
* **files of a claim kind**: per kind of claim (a class of ``keel/experiments/study`` assigning
  ``kind = "NAME"``), the files of ``keel/`` holding one of its pieces: its class, a verdict
  function ``claim_NAME``, a registry literal (a tuple, list or dict) naming its class; the
  most over the kinds is what adding a kind touches besides its ``[[claims]]`` block.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections import Counter
from pathlib import Path

RECORD_FIELDS = {"group", "name", "scheme", "sublayers", "seed", "lr", "scheme_version", "values", "status", "tokens",
                 "final_val_loss", "first_val_loss", "capped_loss", "verdict", "divergence", "diverged", "max_lr",
                 "peak_lr", "wall_s", "plateau_exit_step", "curve", "early_spike", "ablation", "restored", "message",
                 "unigram_entropy", "result"}
# fields no other dict of keel/experiments has (rows, claims and verdict dicts also have "sublayers", "scheme",
# "lr", "group", "tokens", "max_lr", "verdict" ...): reads of these are reads of run records (or of result.json)
RECORD_ONLY = {"status", "capped_loss", "final_val_loss", "first_val_loss", "plateau_exit_step", "wall_s", "divergence",
               "diverged", "early_spike", "ablation", "restored", "curve", "result", "scheme_version"}
SERIALISATION = {"record.py", "job_result.py"}  # the modules that read and write the typed records' dict forms
RUN_FILES = {"config.toml", "metrics.jsonl", "result.json", "job.json", "run.log", "sample.txt", "trainer.pt",
             "manifest.json", ".keel.lock", "checkpoints"}


def _str_key(node: ast.AST) -> str | None:
    """The string key of ``x["k"]`` or ``x.get("k", ...)``, else None."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str):
        return node.slice.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args \
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _owner(node: ast.AST) -> ast.AST:
    return node.value if isinstance(node, ast.Subscript) else node.func.value


def key_reads(root: Path) -> dict:
    """String-key reads in keel/experiments: all, distinct keys, and record-field reads on a plain name."""
    total, keys, record, only = 0, Counter(), Counter(), Counter()
    for path in sorted((root / "keel" / "experiments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            k = _str_key(node)
            if k is None:
                continue
            total += 1
            keys[k] += 1
            if k in RECORD_FIELDS and isinstance(_owner(node), ast.Name) and path.name not in SERIALISATION:
                record[path.relative_to(root).as_posix()] += 1
                only[path.relative_to(root).as_posix()] += k in RECORD_ONLY
    return {"all": total, "keys": len(keys), "record": sum(record.values()), "record_by_file": dict(record),
            "record_only": sum(only.values()), "record_only_by_file": {f: n for f, n in only.items() if n}}


def record_shapes(root: Path) -> list[str]:
    """Places that spell five or more record fields as string constants (a key list or a dict literal)."""
    out = []
    for path in sorted((root / "keel").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            elif isinstance(node, ast.Dict):
                names = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
                names = [k.arg for k in node.keywords if k.arg]
            else:
                continue
            if len(set(names) & RECORD_FIELDS) >= 5:
                out.append(f"{rel}:{node.lineno}")
    return out


def run_file_names(root: Path) -> dict[str, list[str]]:
    """``{file: [run-folder names it spells]}`` over keel/."""
    out = {}
    for path in sorted((root / "keel").rglob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= {f for f in RUN_FILES if node.value == f or node.value.endswith("/" + f)}
        if found:
            out[path.relative_to(root).as_posix()] = sorted(found)
    return out


class _Complexity(ast.NodeVisitor):
    """Radon's cyclomatic complexity of one function body (nested functions and classes left out)."""

    def __init__(self) -> None:
        self.n = 1

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Assert)):
            self.n += 1
        elif isinstance(node, ast.ExceptHandler):
            self.n += 1
        elif isinstance(node, ast.comprehension):
            self.n += 1 + len(node.ifs)
        elif isinstance(node, ast.BoolOp):
            self.n += len(node.values) - 1
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and node.orelse:
            self.n += 1
        if isinstance(node, ast.Try) and node.orelse:
            self.n += 1
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                self.visit(child)


def complex_functions(root: Path, above: int = 20) -> list[tuple[int, str]]:
    """``[(complexity, file:function)]`` of keel/'s functions above ``above``, worst first."""
    out = []
    for path in sorted((root / "keel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                v = _Complexity()
                for stmt in node.body:
                    v.visit(stmt)
                if v.n > above:
                    out.append((v.n, f"{path.relative_to(root).as_posix()}:{node.name}"))
    return sorted(out, reverse=True)


def code_lines(root: Path) -> tuple[int, int]:
    """(code lines outside docstrings, all lines) of keel/experiments."""
    code = total = 0
    for path in sorted((root / "keel" / "experiments").rglob("*.py")):
        src = path.read_text(encoding="utf-8")
        total += len(src.splitlines())
        doc = set()
        for node in ast.walk(ast.parse(src)):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                doc |= set(range(body[0].lineno, body[0].end_lineno + 1))
        lines = set()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENDMARKER):
                lines |= set(range(tok.start[0], tok.end[0] + 1))
        code += len(lines - doc)
    return code, total


def claim_kind_files(root: Path) -> dict[str, list[str]]:
    """``{kind: [files]}``: per kind of claim the files of keel/ holding its class, its ``claim_KIND``
    verdict function or a registry literal naming its class."""
    trees = {path.relative_to(root).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
             for path in sorted((root / "keel").rglob("*.py"))}
    kinds = {}  # class name -> (kind, file)
    for f, tree in trees.items():
        if not f.startswith("keel/experiments/study/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    target = stmt.target if isinstance(stmt, ast.AnnAssign) else (
                        stmt.targets[0] if isinstance(stmt, ast.Assign) else None)
                    if isinstance(target, ast.Name) and target.id == "kind" and isinstance(stmt.value, ast.Constant) \
                            and stmt.value.value:
                        kinds[node.name] = (stmt.value.value, f)
    out = {kind: {f} for kind, f in kinds.values()}
    for f, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("claim_") and node.name[6:] in out:
                out[node.name[6:]].add(f)
            if isinstance(node, (ast.Tuple, ast.List, ast.Dict)):
                for elt in (node.values if isinstance(node, ast.Dict) else node.elts):
                    if isinstance(elt, ast.Name) and elt.id in kinds:
                        out[kinds[elt.id][0]].add(f)
    return {kind: sorted(files) for kind, files in out.items()}


def main(root: Path) -> None:
    reads = key_reads(root)
    shapes = record_shapes(root)
    files = run_file_names(root)
    cc = complex_functions(root)
    code, total = code_lines(root)
    kinds = claim_kind_files(root)
    print(f"measures of {root}")
    print(f"string-key reads in keel/experiments: {reads['all']} ({reads['keys']} keys); of run-record fields on a "
          f"plain name outside (de)serialisation: {reads['record']}")
    print(f"  of those, of fields only a run record has (status, capped_loss, final_val_loss, wall_s ...): "
          f"{reads['record_only']}")
    for f, n in sorted(reads["record_by_file"].items(), key=lambda x: -x[1]):
        print(f"    {n:4d} ({reads['record_only_by_file'].get(f, 0):3d} record-only)  {f}")
    print(f"record shapes (places spelling >= 5 record keys): {len(shapes)}: {', '.join(shapes)}")
    print(f"files spelling a run-folder file name: {len(files)}")
    for f, names in files.items():
        print(f"    {f}: {', '.join(names)}")
    print(f"functions above cyclomatic complexity 20: {len(cc)}")
    for n, f in cc:
        print(f"    {n:3d}  {f}")
    print(f"code lines of keel/experiments outside docstrings: {code} ({total} lines in all)")
    print(f"files touched to add a claim kind (most over the {len(kinds)} kinds, besides its [[claims]] block): "
          f"{max((len(f) for f in kinds.values()), default=0)}")
    for kind, names in kinds.items():
        print(f"    {kind}: {', '.join(names)}")


if __name__ == "__main__":
    if len(sys.argv) > 2 or sys.argv[1:] and sys.argv[1].startswith("-"):
        sys.exit(__doc__.split("\n\n")[1])  # usage: one optional ROOT
    tree = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    if not (tree / "keel" / "experiments").is_dir():
        sys.exit(f"code_measures: {tree} is not a checkout of keel (no keel/experiments there)")
    main(tree)
