"""Formatting shared by the HTML views: one escape for text put into markup."""

from __future__ import annotations

import html as _html

__all__ = ["esc"]


def esc(value) -> str:
    """`value` as text safe inside HTML elements and attribute values (quotes escaped too)."""
    return _html.escape(str(value), quote=True)
