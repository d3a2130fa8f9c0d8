"""Every view of what numguard_nb found; views format, they never compute statistics.

A `Report`: `text` (Hugging Face's DebugUnderflowOverflow format), `table` (a pandas
DataFrame), `html` (the module tree as static HTML), `svg` (the abs-max chart in its header)
and `widget` (the same tree as ipywidgets, with the HTML and text as fallbacks). A comparison
of two reports: `compare`. A replay's result: `replay`. The pipeline doctor's checklist:
`checklist`. `_format.esc` is the one escape for text put into HTML.

Views import the report and the vocabulary (`_schema`), never the engine; the report reaches
its views through lazy imports in its `to_*` / `_repr_*` methods.
"""
