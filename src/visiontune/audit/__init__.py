"""``visiontune audit``: a data set's probable label errors, duplicates, leaks and outliers.

``folds`` (out-of-fold probabilities: K runs of ``training.job``, each scored on the fold it held out by
``inference.loaded``; kept per fold, so a stopped audit continues), ``hashing`` (one pass over the images:
content hashes, thumbnails for near copies, degenerate images), ``issues`` (cleanlab's confident learning
and out-of-distribution score, duplicate groups and leaks, as rows), ``pages`` (audit.csv, audit.json,
audit.html) and ``audit`` (the command: bad input refused before anything trains or is written). It sits
between ``cli`` and ``inference``/``tuning``: it may import every wing below it, and nothing imports it.
"""
