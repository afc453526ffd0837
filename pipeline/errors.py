"""The pipeline's exceptions. Every message says what went wrong and what to do next.

- ``UserError`` (and subclasses): the config or an input is wrong; the user fixes it. Tasks print the
  message and exit 2, never a traceback.
- ``EnvironmentProblem``: the machine lacks something (a GPU, TensorRT-LLM, a package, network); exit 3.
- ``StageFailed``: a stage ran and failed on valid input (a crash, a gate); exit 1, with the log's path.

Each class names its section of the troubleshooting page (``docs_anchor``; ``docs_link()`` gives the page and
anchor); tests/test_docs.py holds every anchor to a heading there.
"""

TROUBLESHOOTING_PAGE = "docs/troubleshooting.md"


class PipelineError(Exception):
    exit_code = 1
    docs_anchor = "pipelineerror"

    @classmethod
    def docs_link(cls) -> str:
        """Where this error's causes and fixes are written: ``docs/troubleshooting.md#<anchor>``."""
        return f"{TROUBLESHOOTING_PAGE}#{cls.docs_anchor}"


class UserError(PipelineError, ValueError):
    exit_code = 2
    docs_anchor = "usererror"


class ConfigError(UserError):
    """A config file is invalid: names the file, the YAML path, the bad value and what is valid."""

    docs_anchor = "configerror"


class InputError(UserError):
    """An input the config points at is missing, unreadable or not what it claims to be."""

    docs_anchor = "inputerror"


class IntegrityError(InputError):
    """Downloaded or recorded content does not match its expected hash."""

    docs_anchor = "integrityerror"


class WorkDirBusy(UserError):
    """Another run holds the work dir's lock."""

    docs_anchor = "workdirbusy"


class EnvironmentProblem(PipelineError, RuntimeError):
    exit_code = 3
    docs_anchor = "environmentproblem"


class StageFailed(PipelineError, RuntimeError):
    exit_code = 1
    docs_anchor = "stagefailed"


class GateFailed(StageFailed):
    """The quantize stage's accuracy gate refused the quantized model (`invoke optimize` drops such a candidate)."""

    docs_anchor = "gatefailed"
