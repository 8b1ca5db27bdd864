"""loading: how images reach the model: the job's data, the image cache, datasets, sampling, augmentation, loaders.

Owns: the job's data screened once per machine and shared by its processes (``jobdata``), the
decoded-image cache, the dataset and epoch sampler that make resume exact, the balanced sampler,
augmentation and the loaders. Reads what ``data`` lists and decodes; may import data, cluster,
settings, models and the foundation.
"""
