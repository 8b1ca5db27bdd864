"""data: what the images are and where their labels are: layouts, readers, the split, decoding, the bad-file check.

Owns: finding the images and their raw label cells (the sources of ``sources.py``: a folder's three layouts,
manifests, ``hf:`` data sets, WebDataset shards, local or copied from a URL), read by the task handed down
(``imageset.LabelReader``: ``tasks`` is a wing above, never imported here), handing the listing to
a job's workers, splitting it once, decoding one file into pixels and naming the files that do not
decode. How decoded images become batches is ``loading``'s. May import cluster (rank, thread
budget), settings, models (the model's resize view) and the foundation.
"""
