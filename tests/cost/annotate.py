"""The rows of `callgrind_annotate` output, for the cost scripts beside it
(callgrind.sh, callgrind-verbs.sh)."""
import re

ROW = re.compile(r"\s*([\d,]+)\s+\([^)]*\)\s+(.*)$")


def rows(path):
    """(instructions, the rest of the row) for each counted row of an
    annotation; the program's total is the row named "PROGRAM TOTALS"."""
    for line in open(path, errors="replace"):
        m = ROW.match(line)
        if m:
            yield int(m.group(1).replace(",", "")), m.group(2)
