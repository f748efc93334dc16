"""A latency profile for XLA:GPU's scheduler from the planner's step model (``--latency-profile-out``).

XLA:GPU's latency-hiding scheduler decides which compute runs under each asynchronous collective from its cost
estimates. Without a profile they are fixed guesses (every collective costs the same, whatever it moves), so a
layer loop's 470 MB gradient reduce-scatter can be given the same slot, one small GEMM, as a 30 MB one. With a
profile (``xla_gpu_pgle_profile_file_or_directory_path``, the file JAX's profile-guided latency estimation
writes from measured runs) it schedules by each instruction's cost. This module writes that file from the step
model's costs: each scheduled compute instruction's time and each collective's transfer time
(``Schedule.instruction_costs``), keyed by the name the scheduler knows it by. ``train.latency_profile`` hands
it to the compile of the same config (the trainer's, the AOT compile's, the planner's), whose instruction names
it matches. The format is the text form of tensorflow.profiler.ProfiledInstructionsProto: one
``costs { name: ... cost_us: ... }`` per instruction, in a file whose name ends in ``.pbtxt`` (XLA chooses the
parser by the suffix and silently skips a file with another one).
"""

from __future__ import annotations

import re

_LINE = re.compile(r'^costs \{ name: "([^"]+)" cost_us: ([0-9.eE+\-]+) \}$')


def profile_text(costs: dict) -> str:
    """The profile of ``costs`` (seconds by instruction name), in microseconds."""
    return "".join(f'costs {{ name: "{name}" cost_us: {secs * 1e6:.3f} }}\n' for name, secs in sorted(costs.items()))


def write_profile(costs: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write(profile_text(costs))


def read_profile(path: str) -> dict:
    """Seconds by instruction name of a profile :func:`write_profile` wrote."""
    out = {}
    with open(path) as f:
        for line in f:
            m = _LINE.match(line.strip())
            if m:
                out[m.group(1)] = float(m.group(2)) / 1e6
    return out
