"""data: what the images and labels are: layouts, readers, label sets, the split, decoding, the bad-file check.

Owns: finding the images and labels (the sources of ``sources.py``: a folder's three layouts,
manifests, ``hf:`` data sets, WebDataset shards, local or copied from a URL), handing the listing to
a job's workers, splitting it once, decoding one file into pixels and naming the files that do not
decode. How decoded images become batches is ``loading``'s. May import cluster (rank, thread
budget), settings, models (the model's resize view) and the foundation.
"""
