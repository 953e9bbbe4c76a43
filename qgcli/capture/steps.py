"""Which training steps a capture records: the whole ``with`` block as one step, or the steps of a loop marked
with ``with cap.step(i):`` and chosen by ``steps=`` / ``every=``; shared by the PyTorch and TensorFlow
captures."""
import contextlib


class StepCapture:
    """What a capture recorded: ``groups`` (run-file group paths of the last step, below the step group),
    ``skipped`` (name -> why it was not recorded) and the ``writer``.  :meth:`step` marks the steps of a
    training loop; without it the whole block is one step."""

    def __init__(self, writer, *, steps=None, every=None):
        self.writer = writer
        self.skipped = {}
        self.steps = None if steps is None else {int(s) for s in steps}
        if every is not None and (isinstance(every, bool) or int(every) != every or every < 1):
            raise ValueError(f"every={every!r} must be a positive integer")
        self.every = every
        self.active = True  # the whole block is the step until step() is called
        self.explicit = False
        self.pending = []  # (name, path, check() -> why the group goes, or None), run when the step ends
        self.calls = {}  # hooked name -> its calls so far in this step

    @property
    def groups(self):
        return list(self.writer.groups)

    def selected(self, step):
        """Whether training step ``step`` is captured (``steps=`` and ``every=``)."""
        return (self.steps is None or step in self.steps) and (self.every is None or step % self.every == 0)

    @contextlib.contextmanager
    def step(self, step):
        """One training step of a loop: captured when :meth:`selected`, under ``step_<N>/``; yields whether."""
        chosen = self.begin(step)
        try:
            yield chosen
        except BaseException:
            self.abort()
            raise
        self.finish()

    def begin(self, step):
        """Start training step ``step`` (what :meth:`step` does on entry); returns whether it is captured."""
        if not self.explicit:  # what ran in the block before its first step is no step
            self.explicit = True
            self.writer.discard_step()
        self.active = False
        if not self.selected(step):
            return False
        self.writer.begin_step(step)
        self.pending, self.calls, self.active = [], {}, True
        return True

    def finish(self):
        """End the step begun: commit it to the file (when captured)."""
        if self.active:
            self.active = False
            self.end_step()
            self.writer.commit_step()

    def abort(self):
        """End the step begun without writing it."""
        self.active = False
        self.writer.discard_step()

    def end_step(self):
        """Drop the groups that turned out incomplete (a batch norm no gradient reached)."""
        for name, path, check in self.pending:
            reason = check()
            if reason:
                self.skipped[name] = reason
                self.writer.drop(path)
        self.pending = []
