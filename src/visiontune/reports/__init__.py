"""reports: the numbers and the pages that show them -- metrics, figures, report.html, bench and its table.

Owns: classification metrics, matplotlib figures, the self-contained report page and the
strategy benchmark. May import runs (a run folder's records, read back through ``runs.runrecords`` and
``runs.evalrecords``),
data (images for figures), cluster (bench starts jobs), settings, models and the foundation.
"""
