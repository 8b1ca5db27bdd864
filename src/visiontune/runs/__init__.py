"""runs: the run folder -- records, the model file's self-description, checkpoints, resume, lock, disk space.

Owns: every file a run leaves behind and the rules for reading them back (resume, later
commands). May import reports (the page written at the end), data, cluster, settings, models and
the foundation.
"""
