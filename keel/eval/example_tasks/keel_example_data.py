"""Datasets of the example tasks, read from the JSON Lines files beside this file.

The task YAMLs name :func:`load` as their ``custom_dataset`` (``!function
keel_example_data.load``), which lm-evaluation-harness resolves relative to the YAML: the
tasks then work with plain ``lm_eval --include_path <this folder>`` from any working
directory, keel installed or not (a relative ``data_files`` path would be resolved against
the working directory by ``datasets``).
"""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(data_file: str, **_metadata):
    """``{"test": Dataset}`` of ``HERE / data_file`` (one JSON object per line).

    ``**_metadata``: the task's ``metadata`` (e.g. ``version``), which lm-eval passes too.
    """
    return datasets.load_dataset("json", data_files={"test": str(HERE / data_file)})
