"""The methods of the library's method table as the Python modules use them.

The names and traits come from the C++ rows (``poslsh.method_names(**traits)``,
``poslsh.method_traits(method)``); FlashAttention-style calls (flash_attn_*, AlibiSelfAttention)
and the context-parallel cost model also take the short names of ALIASES.
"""

from . import _core

# Short names of methods, FlashAttention-style.
ALIASES = {"exact": "exact_tiled", "banded": "exact_banded", "lsh": "lsh_fused"}


def accepted(**traits):
    """{accepted name: method} of the methods with the given traits (method_names' keywords):
    their short names first, then the table's names, in the table's order."""
    methods = _core.method_names(**traits)
    return {**{alias: method for alias, method in ALIASES.items() if method in methods},
            **{method: method for method in methods}}


def short_name(method):
    """The short name of a method of the table (its table name when it has none)."""
    return next((alias for alias, target in ALIASES.items() if target == method), method)


def short_names(methods):
    """The short names of methods, quoted and joined by commas and a last "and" (for messages)."""
    names = [repr(short_name(method)) for method in methods]
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]
