"""The one stylesheet of every page visiontune writes (``report.html``, ``compare.html``, ``tune.html``).

Each page inlines it, so that it stays one self-contained file; a page's own classes live here too, so the
three look alike and a change of style is made once.
"""

CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;margin-top:2em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ddd;padding:2px 8px;text-align:right}th{background:#f4f4f4}td.l,th.l{text-align:left}
td.name{text-align:left;max-width:28em;overflow-wrap:anywhere}img{max-width:100%;height:auto;display:block}
.note{color:#666}.wide{max-width:100%;overflow-x:auto}
tr.differs th,tr.differs td{background:#fff6d5}
tr.pruned td{color:#b00}tr.best td{font-weight:bold}.bar{background:#4a7ab0;height:.8em;display:inline-block}"""
