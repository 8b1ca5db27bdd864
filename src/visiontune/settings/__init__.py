"""settings: ``TrainConfig``, its checks and the recipe presets -- what a run is asked to do.

Owns: the frozen config, type and range checks, config files, and resolving ``--recipe`` presets
into values. May import models (a preset's normalisation can come from the weights) and the
foundation.
"""
