"""data: layouts and readers, the split, decoding, the cache, augmentation, loaders and the sample data.

Owns: finding the images and labels, splitting them once, turning files into tensors and
batches. May import cluster (rank, thread budget), settings, models (the model's resize view) and
the foundation.
"""
