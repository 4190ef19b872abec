"""Evaluation: perplexity and bits per byte on held-out text, and lm-evaluation-harness tasks.

* :mod:`keel.eval.perplexity` -- next-token loss, perplexity and bits per byte of a model
  on a run's validation split or on a text file.
* :mod:`keel.eval.tasks` -- benchmark tasks through ``lm_eval`` (:func:`keel.eval.tasks.run_tasks`
  is what the trainer calls every ``train.eval_tasks_every`` steps).
* the ``keel eval``, ``keel export-hf`` and ``keel import-hf`` commands are in
  :mod:`keel.cli.commands.scoring` and :mod:`keel.cli.commands.hf`.

Nothing heavy is imported here (``keel --help`` stays fast); torch, transformers and lm_eval
are imported inside the functions that need them.
"""
