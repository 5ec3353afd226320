"""The oldest PyTorch the torch modules of poslsh support, checked at import."""

import re

import torch

#: The oldest torch release poslsh.torch supports (and is tested with): its operators are
#: torch.library.custom_op with register_fake and register_autograd.
MINIMUM = (2, 13)


def require(module):
    """ImportError naming `module` and the required version when the installed torch is older
    than MINIMUM (the version's leading "major.minor"; local tags such as "+cpu" are ignored)."""
    found = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if found is None or (int(found.group(1)), int(found.group(2))) < MINIMUM:
        raise ImportError(f"{module} requires torch >= {MINIMUM[0]}.{MINIMUM[1]}, found torch {torch.__version__} "
                          f"(pip install 'torch>={MINIMUM[0]}.{MINIMUM[1]}')")
