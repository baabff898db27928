"""Showing a figure inline when running in a notebook's kernel."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ("show_or_return",)


def show_or_return(figure: Any) -> Any:
    """In a Jupyter kernel: display ``figure`` and return ``None``; elsewhere: return it.

    A bare ``Figure`` (not pyplot's) has no rich display of its own, so a
    notebook would print its repr rather than the picture.
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None  # type: ignore[attr-defined]
    if shell is None or "IPKernelApp" not in getattr(shell, "config", {}):
        return figure
    import io

    from IPython.display import Image, display

    # As a PNG: that shows whether or not the kernel's matplotlib integration was ever switched on.
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    display(Image(data=buffer.getvalue(), format="png"))
    return None
