"""Hyperparameter search over Optuna: ``visiontune tune``.

``space`` (the searched settings: a TOML file or a recipe's default), ``store`` (the study store's one
reader: every value read back from a study goes through its schema), ``study`` (storage, what a study is
of, heartbeats and stale trials), ``tune`` (the tuner's loop: each trial an ordinary run through
``training.trainer.train``; ``--parallel`` processes), ``trialjob`` (pruning at epoch boundaries, and a trial
that is a job of several processes) and ``results``
(``best.toml``, the terminal table, ``tune.html``). It sits beside ``inference``: it may import every wing
below it (training, runs, reports, settings...), and nothing below imports it or Optuna.
"""

# In a trial that runs as a job of its own (``trialjob``): what the trial is, for the job's main process.
TRIAL_ENV = "VISIONTUNE_TUNE_TRIAL"
