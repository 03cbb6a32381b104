"""The errors a run reports to its user: one class per kind of fault, each message one line naming the
flag, file or iteration and the fix. A leaf module: every package raises these, and the entry point
(:mod:`megazero.cli`) decides from the class alone how a run ends (its exit status, which ranks say
the line).

=====================  =============================================  ==========================
class                  raised when                                    the run ends
=====================  =============================================  ==========================
``ConfigError``        flags contradict each other or the layout      status 2, before any group
``PreflightError``     a file, directory or the machine cannot serve  status 2, before any group
``NothingToDo``        the checkpoint resumed has finished training   status 0, said once
``DataError``          data options or files are unusable             status 2 before, 1 after
``TokenizerError``     a tokenizer file is missing or unusable        status 2, before any group
``CheckpointError``    a checkpoint is missing, incomplete, corrupt   status 1
                       or does not fit the model
``TrainingStopped``    the run cannot go on (a non-finite loss, too   status 1, nothing saved
                       many skipped steps)
``ReplicaGroupLost``   this rank's torchft Manager lost the replica   status 1, said by each rank
                       groups' quorum (a ``TrainingStopped``)         that saw it
=====================  =============================================  ==========================
"""


class ConfigError(ValueError):
    """An invalid configuration; the message names the flag and the fix."""


class PreflightError(ValueError):
    """An input the run cannot use; the message names the flag and the fix."""


class NothingToDo(PreflightError):
    """The checkpoint to resume has already reached ``--train-iters``: the run has nothing left to train
    (the message says so; the trainer exits with status 0)."""


class DataError(ValueError):
    """Unusable data options or files; the message names the flag or file and the fix."""


class TokenizerError(ValueError):
    """A tokenizer file that is missing or unusable; the message names the flag, file and fix."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model."""


class TrainingStopped(RuntimeError):
    """The run cannot go on (a non-finite loss or gradient, too many skipped steps): the message says
    why and at which iteration; nothing of the bad state has been saved."""


class ReplicaGroupLost(TrainingStopped):
    """This rank's torchft Manager lost the replica groups' quorum or commit vote and cannot go on in this
    process (``--fault-tolerance torchft``): the group is to be restarted, and heals from a live one. The
    ranks of a group can meet it at different moments, or only some of them, so each says it."""
