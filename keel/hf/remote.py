"""Modeling code for an exported folder, generated from keel's own source at export time.

``keel export-hf`` writes two Python files beside the weights (named with a hash of their
content, :func:`write_remote_code`) and points ``auto_map`` in ``config.json`` at them, so
that anyone can load the folder without keel installed::

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

* ``configuration_keel.py`` = ``keel/errors.py`` + ``ModelConfig`` (from ``keel/config.py``)
  + ``keel/hf/configuration.py``;
* ``modeling_keel.py`` = ``keel/model/norm.py`` + the ``keel/model/residual/`` modules +
  ``keel/model/model.py`` + ``keel/hf/modeling.py``, importing ``configuration_keel.py`` relatively.

There is one copy of the architecture to maintain: the files are the source of those
modules as they are installed, concatenated, with every ``from keel... import`` line
removed (the names it imported are defined earlier in the same file, or in
``configuration_keel.py``). :func:`generate_remote_code` refuses (KeelError) if any import
of ``keel`` is left anywhere in the result, including lazy imports inside functions, so
adding such an import to the model code makes export fail loudly instead of producing
a folder that only loads where keel is installed.

Why not ``register_for_auto_class``: ``save_pretrained`` would then copy the file that
defines the class, ``keel/hf/modeling.py``, which imports keel. We write the generated
files and the same ``auto_map`` keys transformers writes for registered classes
(``AutoConfig``, ``AutoModelForCausalLM``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import json
from pathlib import Path

import keel
from keel.errors import KeelError
from keel.io import atomic_write_text

CONFIG_FILE = "configuration_keel.py"  # written as configuration_keel_<hash>.py (write_remote_code)
MODELING_FILE = "modeling_keel.py"  # written as modeling_keel_<hash>.py


def _is_keel_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] == "keel"
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "keel" for a in node.names)
    return False


def _strip(source: str, origin: str) -> tuple[list[str], str]:
    """(``from __future__`` lines, body) of one module's source: its docstring and its
    top-level keel imports removed; an ``import ... as alias`` becomes ``alias = name``."""
    tree = ast.parse(source)
    lines = source.splitlines()
    drop: set[int] = set()
    future, aliases = [], []
    for i, node in enumerate(tree.body):
        span = range(node.lineno - 1, node.end_lineno)
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            drop.update(span)  # the module docstring
        elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
            future.append(ast.unparse(node))
            drop.update(span)
        elif _is_keel_import(node):
            if isinstance(node, ast.Import):
                raise KeelError(f"{origin}: 'import keel...' cannot be rewritten for exported code; "
                                "use 'from keel.x import name'")
            aliases += [f"{a.asname} = {a.name}" for a in node.names if a.asname and a.asname != a.name]
            drop.update(span)
    body = "\n".join(ln for j, ln in enumerate(lines) if j not in drop).strip("\n")
    return future, body + ("\n\n" + "\n".join(aliases) if aliases else "")


def _check_no_keel(text: str, what: str) -> None:
    """Raise KeelError if ``text`` imports keel anywhere (top level or inside a function)."""
    for node in ast.walk(ast.parse(text)):
        if _is_keel_import(node):
            raise KeelError(f"generated {what} still imports keel at line {node.lineno} "
                            f"({ast.unparse(node)}): move that import out of the model code")


# Modules with I/O dependencies (tomli_w, ...) that the exported code must not require: only the
# names the model code uses are copied from them (with the imports and helpers those need).
SELECTIVE = ("keel.config",)


def _defining_module(module: str, name: str) -> str:
    """The module that defines ``name`` imported from ``module`` (packages re-export names)."""
    obj = getattr(importlib.import_module(module), name)
    return getattr(obj, "__module__", module) if isinstance(obj, type) or callable(obj) else module


def _keel_deps(source: str) -> list[tuple[str, str]]:
    """``[(defining module, name)]`` of every top-level ``from keel... import name`` in ``source``."""
    deps = []
    for node in ast.parse(source).body:
        if _is_keel_import(node) and isinstance(node, ast.ImportFrom):
            deps += [(_defining_module(node.module, a.name), a.name) for a in node.names]
    return deps


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _select(source: str, names: set[str]) -> str:
    """The top-level statements of ``source`` that ``names`` need, transitively (definitions,
    constants and imports, in file order); never a keel import or an ``if``/``try`` block."""
    body = [n for n in ast.parse(source).body if not _is_keel_import(n)]
    need, keep = set(names), set()
    while True:
        new = {i for i, n in enumerate(body) if i not in keep and _bound_names(n) & need}
        if not new:
            break
        keep |= new
        for i in new:
            need |= {x.id for x in ast.walk(body[i]) if isinstance(x, ast.Name)}
            need |= {x.value.id for x in ast.walk(body[i]) if isinstance(x, ast.Attribute)
                     and isinstance(x.value, ast.Name)}
    lines = source.splitlines()

    def segment(node: ast.stmt) -> str:  # with its decorators
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "\n".join(lines[start - 1:node.end_lineno])

    return "\n\n\n".join(segment(body[i]) for i in sorted(keep)
                          if not isinstance(body[i], ast.ImportFrom) or body[i].module != "__future__")


def _collect(root: str, done: dict[str, set[str] | None]) -> None:
    """Add ``root`` and the keel modules it imports from (first) to ``done``, in dependency
    order: ``{module: None}`` = the whole module, ``{module: names}`` for :data:`SELECTIVE`
    (whose own keel imports are collected whole)."""
    source = inspect.getsource(importlib.import_module(root))
    for module, name in _keel_deps(source):
        if module in SELECTIVE:
            if module not in done:
                for dep, _ in _keel_deps(inspect.getsource(importlib.import_module(module))):
                    if dep not in done and dep not in SELECTIVE:
                        _collect(dep, done)
            done.setdefault(module, set()).add(name)
        elif module not in done:
            _collect(module, done)
    done.setdefault(root, None)


def _parts(done: dict[str, set[str] | None], modules: list[str]) -> list[tuple[str, str]]:
    """``[(origin, source)]`` of ``modules`` (whole, or the selected names of a SELECTIVE one)."""
    parts = []
    for module in modules:
        source, names = inspect.getsource(importlib.import_module(module)), done[module]
        if names is None:
            parts.append((module, source))
        else:
            parts.append((f"{module} ({', '.join(sorted(names))})",
                          "from __future__ import annotations\n\n" + _select(source, names)))
    return parts


def _join(parts: list[tuple[str, str]], header: str, extra_imports: str = "") -> str:
    """One Python file from ``[(origin, source)]``: a header, the hoisted ``__future__``
    imports, ``extra_imports``, then each stripped source under a ``# --- from origin`` line."""
    futures: list[str] = []
    bodies = []
    for origin, source in parts:
        future, body = _strip(source, origin)
        futures += [f for f in future if f not in futures]
        bodies.append(f"# {'-' * 20} from {origin}\n\n{body}\n")
    text = f'"""{header}"""\n\n' + "\n".join(futures) + "\n\n"
    if extra_imports:
        text += extra_imports + "\n\n"
    text += "\n\n".join(bodies)
    _check_no_keel(text, header.splitlines()[0])
    return text


def generate_remote_code() -> dict[str, str]:
    """``{file name: Python source}`` of the two files an exported folder carries (see the
    module docstring): the configuration file holds ``keel.hf.configuration`` and what it
    needs (plus the names the model code takes from :data:`SELECTIVE` modules); the modeling
    file holds ``keel.hf.modeling`` and the rest of its keel dependencies.
    Raises KeelError if the result would still import keel."""
    done: dict[str, set[str] | None] = {}
    _collect("keel.hf.configuration", done)
    config_mods = list(done)
    _collect("keel.hf.modeling", done)
    config_mods += [m for m in done if m in SELECTIVE and m not in config_mods]
    config_mods = [m for m in done if m in config_mods]  # dependency order
    model_mods = [m for m in done if m not in config_mods]
    imported = sorted({n for m in model_mods for dep, n in _keel_deps(inspect.getsource(importlib.import_module(m)))
                       if dep in config_mods})
    header = ("Generated by keel {v} from its own source ({mods}); do not edit.\n\n"
              "Load with transformers only: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).\n")
    config_code = _join(_parts(done, config_mods), header.format(v=keel.__version__, mods=", ".join(config_mods)))
    modeling_code = _join(_parts(done, model_mods), header.format(v=keel.__version__, mods=", ".join(model_mods)),
                          extra_imports=f"from .{CONFIG_FILE[:-3]} import {', '.join(imported)}")
    return {CONFIG_FILE: config_code, MODELING_FILE: modeling_code}


def write_remote_code(folder: str | Path) -> dict[str, str]:
    """Write the generated files into ``folder`` (which holds a keel ``config.json``) and add
    ``auto_map`` to its ``config.json``. Returns the ``auto_map`` written.

    The files are named with a hash of their content, ``configuration_keel_<h>.py`` and
    ``modeling_keel_<h>.py`` (``h``: 12 hex digits of the sha256 of both sources):
    transformers caches remote code as a module named after the folder's base name and the
    file name, so two exports called ``model`` with different code (two keel versions)
    loaded in one process would otherwise both run the first one's code."""
    folder = Path(folder)
    files = generate_remote_code()
    digest = hashlib.sha256("".join(files[k] for k in sorted(files)).encode("utf-8")).hexdigest()[:12]
    config_mod, modeling_mod = f"{CONFIG_FILE[:-3]}_{digest}", f"{MODELING_FILE[:-3]}_{digest}"
    modeling = files[MODELING_FILE].replace(f"from .{CONFIG_FILE[:-3]} import", f"from .{config_mod} import", 1)
    atomic_write_text(folder / f"{config_mod}.py", files[CONFIG_FILE])
    atomic_write_text(folder / f"{modeling_mod}.py", modeling)
    auto_map = {"AutoConfig": f"{config_mod}.KeelConfig", "AutoModelForCausalLM": f"{modeling_mod}.KeelForCausalLM"}
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map
    atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return auto_map
