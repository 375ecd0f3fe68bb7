"""Typed errors. Library code raises these; the command line turns them into one line and exit 1."""


class MeshplanError(Exception):
    """A problem with the user's input (model, options, files) that they can fix.

    The message is one line; ``hint`` is an optional short suggestion appended to it.
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} ({self.hint})" if self.hint else text


class ModelError(MeshplanError):
    """The ONNX model cannot be read, checked or given static shapes."""


class ClusterError(MeshplanError):
    """The cluster description is malformed."""


class PlanError(MeshplanError):
    """No valid plan exists, or a plan directory is unusable."""


class RunError(MeshplanError):
    """The runtime cannot start or continue (ranks, inputs, files)."""


class HintError(PlanError):
    """A hint (an annotation of the model or of ``--hints``) that is malformed or cannot hold."""


class ReportedElsewhere(MeshplanError):
    """Start-up of a job failed on another rank, which reports it; this rank only exits 1."""


class JobFailure(RunError):
    """A rank of a job failed after start-up: the whole job must be aborted."""


class TrainError(MeshplanError):
    """A model, loss, optimizer or data set that cannot be trained as asked."""
