"""training: ``train(config)`` -- the run, the epoch loop, hooks, optimizer and loss, schedule, EMA, lr-find.

Owns: everything that happens between a built model and a finished run. May import runs, reports,
data, cluster, settings, models and the foundation; never inference or cli.
"""
