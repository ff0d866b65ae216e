"""The keyword under which this transformers' forwards take a KV cache, chosen once at import.

transformers 5.24 renamed the forwards' ``past_key_values`` keyword, and the outputs' field, to ``cache``
(the old name warns with a ``FutureWarning`` at every call and goes in 5.40); 5.0-5.23 know only
``past_key_values``. Every forward this project makes passes its cache through ``cache_kwarg`` and reads it
back with ``output_cache``, so no call warns and none breaks either side of the rename.

The version is the installed distribution's (``importlib.metadata``), read without importing transformers
(half a second; the project imports it lazily).
"""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

RENAMED_IN = (5, 24)  # the first transformers release whose forwards take ``cache``


def cache_keyword(transformers_version: str) -> str:
    """The forwards' cache keyword (and the outputs' cache field) of ``transformers_version``: "cache" from 5.24
    (its pre-releases included), "past_key_values" before."""
    return "cache" if Version(transformers_version).release[:2] >= RENAMED_IN else "past_key_values"


CACHE_KEYWORD = cache_keyword(version("transformers"))


def cache_kwarg(cache) -> dict[str, object]:
    """``{keyword: cache}`` for a forward call: ``model(ids, **cache_kwarg(cache), use_cache=True)``."""
    return {CACHE_KEYWORD: cache}


def output_cache(output):
    """The cache a forward returned (``output.cache`` from 5.24, ``output.past_key_values`` before)."""
    return getattr(output, CACHE_KEYWORD)
