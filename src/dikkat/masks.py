"""``dikkat.masks``: attention masks (True = may attend). See :mod:`dikkat.core.masks`."""

from dikkat.core.masks import *  # noqa: F403
from dikkat.core.masks import __all__  # noqa: F401
