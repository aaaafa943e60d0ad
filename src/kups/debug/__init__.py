"""Where a program made its NaNs and Infs: `find_nans` and `NanReport`."""

from ._find_nans import find_nans as find_nans
from ._report import NanReport as NanReport

__all__ = ["NanReport", "find_nans"]
