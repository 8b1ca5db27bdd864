"""Run ``visiontune train ARGS`` in this process; print peak RSS (MiB) of this process and of its workers."""

import json
import resource
import sys

from visiontune.cli.commands import main

code = main(["train", *sys.argv[1:]])
peak = {
    "main_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "largest_worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
}
print("RSS " + json.dumps(peak))
sys.exit(code)
