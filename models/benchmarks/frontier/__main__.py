"""``python -m models.benchmarks.frontier SPEC_JSON``: a child measuring one row, one JSON line."""
from models.benchmarks import child
from models.benchmarks.frontier import measurement

if __name__ == "__main__":
  child.child_main(measurement.child_row)
