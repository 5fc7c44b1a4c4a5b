"""Suite results side by side: `python launch/report.py A.json B.json ... [--out DIR]`.

A markdown table and PNG charts across machines; see jaxrl/benchmarks/report.py.
"""

import sys

from jaxrl.benchmarks.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
