#!/usr/bin/env python3
"""The cost model of context parallelism from the command line: a thin command over the module
poslsh.context_parallel_model (its docstring: what is modeled and how).

  python3 bench/context_parallel_model.py                       # projection tables
  python3 bench/context_parallel_model.py --full --plot docs/images/context_parallel_model.png
  python3 bench/context_parallel_model.py --check bytes.json    # measured bytes against the model
  python3 bench/context_parallel_model.py --halos --n 65536 --ranks 8 --model mpt-7b-storywriter
  python3 bench/context_parallel_model.py --update-docs docs/context_parallel.md

Needs the poslsh module (PYTHONPATH=build-py/python); gnuplot for --plot.
"""

import sys

from poslsh import context_parallel_model

if __name__ == "__main__":
    sys.exit(context_parallel_model.main(prog="bench/context_parallel_model.py"))
