"""`python -m diffrelay` is the same as the `diffrelay` console script."""

from diffrelay.cli import entry

entry()
