"""runs: the run folder -- records, the model file's self-description, checkpoints, resume, lock, disk space.

Owns: every file a run leaves behind and the rules for reading them back (resume, later
commands: ``runrecords`` is the one reader of a run folder's training records, ``evalrecords`` of
the evaluations and benches added to it). May import loading, tasks, data,
cluster, settings, models and the foundation; the pages (reports) are made above it.
"""
