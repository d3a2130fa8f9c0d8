"""Every view of what numguard_nb found; views format, they never compute statistics.

A `Report`: `text` (Hugging Face's DebugUnderflowOverflow format), `table` (a pandas
DataFrame), `html` (the module tree as static HTML), `svg` (the abs-max chart in its header)
and `widget` (the same tree as ipywidgets, with the HTML and text as fallbacks). A comparison
of two reports: `compare`. A replay's result: `replay`. The pipeline doctor's checklist:
`checklist`. `_format.esc` is the one escape for text put into HTML.

Views import neither the report nor the engine: they read a report, its frames and rows
through their fields and methods, and import only leaves (the vocabulary `_schema`, the shared
helpers `_util`). The report reaches its views through imports in its `to_*` / `_repr_*` methods.
"""
