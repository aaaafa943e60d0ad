"""Where a program made its NaNs and Infs: `find_nans` (the one that matters) and
`nan_sites` (every one)."""

from ._find_nans import find_nans as find_nans
from ._nan_sites import NanSite as NanSite
from ._nan_sites import NanSites as NanSites
from ._nan_sites import nan_sites as nan_sites
from ._report import NanReport as NanReport

__all__ = ["NanReport", "NanSite", "NanSites", "find_nans", "nan_sites"]


def __dir__() -> list[str]:
    """The public names only (not the private submodules Python sets here)."""
    return sorted(__all__)
