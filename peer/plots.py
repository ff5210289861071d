"""matplotlib, only where plots are made: it is the optional extra ``plots`` (``pip install 'hivegrpo[plots]'``).

The demo's report and the benchmarks' ``--plot`` draw with it; nothing else needs it. :func:`pyplot` gives
``matplotlib.pyplot`` on the file-only Agg backend, or None when matplotlib is not installed (the demo then skips its
plots and says so); :func:`require` stops a benchmark asked for ``--plot`` before it runs for minutes without it.
"""

from __future__ import annotations

INSTALL = "pip install 'hivegrpo[plots]'"
SKIPPED = f"plots skipped: matplotlib is not installed ({INSTALL})"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), or None when matplotlib is not installed.

    Only a missing matplotlib is None: a broken install raises as it is.
    """
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require(option: str = "--plot"):
    """``matplotlib.pyplot`` as :func:`pyplot` gives it; without matplotlib, exit with one line (status 1) saying that
    ``option`` needs it."""
    plt = pyplot()
    if plt is None:
        raise SystemExit(f"{option} needs matplotlib, which is not installed: {INSTALL}")
    return plt


__all__ = ["INSTALL", "SKIPPED", "pyplot", "require"]
