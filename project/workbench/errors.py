"""The one error type the workbench raises for bad input or a failed step."""


class WorkbenchError(Exception):
    """A failure the user can act on; the CLI prints it without a traceback."""
