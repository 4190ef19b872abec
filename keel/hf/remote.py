"""Modeling code for an exported folder, generated from keel's own source at export time.

``keel export-hf`` writes two Python files beside the weights and points ``auto_map`` in
``config.json`` at them, so that anyone can load the folder without keel installed::

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

* ``configuration_keel.py`` = ``keel/errors.py`` + ``ModelConfig`` (from ``keel/config.py``)
  + ``keel/hf/configuration.py``;
* ``modeling_keel.py`` = ``keel/model/residual.py`` + ``keel/model/model.py`` +
  ``keel/hf/modeling.py``, importing the first file relatively.

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
import inspect
from pathlib import Path
from types import ModuleType

from keel.errors import KeelError

CONFIG_FILE = "configuration_keel.py"
MODELING_FILE = "modeling_keel.py"
AUTO_MAP = {
    "AutoConfig": f"{CONFIG_FILE[:-3]}.KeelConfig",
    "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.KeelForCausalLM",
}


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


def _check_no_keel(text: str, what: str) -> None:
    """Raise KeelError if ``text`` imports keel anywhere (top level or inside a function)."""
    for node in ast.walk(ast.parse(text)):
        if _is_keel_import(node):
            raise KeelError(f"generated {what} still imports keel at line {node.lineno} "
                            f"({ast.unparse(node)}): move that import out of the model code")


def _source(obj) -> tuple[str, str]:
    """(``keel/...`` path, source) of a module or class."""
    module = obj if isinstance(obj, ModuleType) else inspect.getmodule(obj)
    origin = module.__name__.replace(".", "/") + ".py"
    return (origin if isinstance(obj, ModuleType) else f"{origin}:{obj.__name__}"), inspect.getsource(obj)


def generate_remote_code() -> dict[str, str]:
    """``{file name: Python source}`` of the two files an exported folder carries (see the
    module docstring). Raises KeelError if the result would still import keel."""
    import keel
    import keel.errors
    import keel.hf.configuration
    import keel.hf.modeling
    import keel.model.model
    import keel.model.residual
    from keel.config import ModelConfig

    header = ("Generated by keel {v} from its own source{extra}; do not edit.\n\n"
              "Load with transformers only: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).\n")
    config_code = _join([_source(keel.errors), _source(ModelConfig), _source(keel.hf.configuration)],
                        header.format(v=keel.__version__, extra=" (keel.errors, keel.config.ModelConfig, "
                                      "keel.hf.configuration)"),
                        extra_imports="from dataclasses import dataclass")
    modeling_code = _join([_source(keel.model.residual), _source(keel.model.model), _source(keel.hf.modeling)],
                          header.format(v=keel.__version__, extra=" (keel.model.residual, keel.model.model, "
                                        "keel.hf.modeling)"),
                          extra_imports=f"from .{CONFIG_FILE[:-3]} import KeelConfig, KeelError, ModelConfig")
    return {CONFIG_FILE: config_code, MODELING_FILE: modeling_code}


def write_remote_code(folder: str | Path) -> dict[str, str]:
    """Write the generated files into ``folder`` (which holds a keel ``config.json``) and add
    ``auto_map`` to its ``config.json``. Returns the ``auto_map`` written."""
    import json

    from keel.io import atomic_write_text

    folder = Path(folder)
    for name, code in generate_remote_code().items():
        atomic_write_text(folder / name, code)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = dict(AUTO_MAP)
    atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dict(AUTO_MAP)
