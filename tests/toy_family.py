"""A toy op family for tests/test_families.py: ``ToyHalve`` halves its inputs.  Everything a family says."""
from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import Result

NAME, KIND = "toy", FAKE_QUANT
LITERAL_OK = ()
RUN_FILE_OPS = {"ToyHalve": None}
GROUP_OPERANDS = {None: (("inputs",), ())}


def job_from_group(run, layer, operand_specs, output, pick):
    from qgcli.jobs import FakeQuantJob

    return FakeQuantJob(command=run.command, family=NAME, with_gradients=run.with_gradients,
                        operands=operand_specs, output=output)


def compute(job, operands):
    import numpy as np

    from qgcli.report.summaries import describe_arrays

    outputs = {"outputs": np.asarray(operands.get("inputs"), np.float32) / 2}
    summary = {"op": "ToyHalve", "outputs": describe_arrays(outputs), "output": job.output.destination, "notes": []}
    return Result(outputs, {"op": "ToyHalve"}, summary)


def render(console, s):
    console.print(s["op"])


def mode(job):
    return "ToyHalve"
