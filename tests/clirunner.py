"""click's CliRunner as click >= 8.2 has it, on every supported click: ``result.stderr`` apart,
``result.output`` both streams (the ``runner`` fixture, and tests that build their own)."""
import inspect


def make_runner():
    from click.testing import CliRunner, Result

    if "mix_stderr" not in inspect.signature(CliRunner).parameters:
        return CliRunner()

    class _Result(Result):  # click 8.1: output is stdout alone when stderr is captured apart
        @property
        def output(self):
            return self.stdout + self.stderr

    class _Runner(CliRunner):
        def invoke(self, *args, **kwargs):
            result = super().invoke(*args, **kwargs)
            result.__class__ = _Result
            return result

    return _Runner(mix_stderr=False)
