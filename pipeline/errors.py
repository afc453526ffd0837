"""The pipeline's exceptions. Every message says what went wrong and what to do next.

- ``UserError`` (and subclasses): the config or an input is wrong; the user fixes it. Tasks print the
  message and exit 2, never a traceback.
- ``EnvironmentProblem``: the machine lacks something (a GPU, TensorRT-LLM, a package, network); exit 3.
- ``StageFailed``: a stage ran and failed on valid input (a crash, a gate); exit 1, with the log's path.
"""


class PipelineError(Exception):
    exit_code = 1


class UserError(PipelineError, ValueError):
    exit_code = 2


class ConfigError(UserError):
    """A config file is invalid: names the file, the YAML path, the bad value and what is valid."""


class InputError(UserError):
    """An input the config points at is missing, unreadable or not what it claims to be."""


class IntegrityError(InputError):
    """Downloaded or recorded content does not match its expected hash."""


class WorkDirBusy(UserError):
    """Another run holds the work dir's lock."""


class EnvironmentProblem(PipelineError, RuntimeError):
    exit_code = 3


class StageFailed(PipelineError, RuntimeError):
    exit_code = 1
