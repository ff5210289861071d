"""The exception types of the tasks package.

Every problem a user can cause (an unknown task name, a bad config, a plug-in that does not import) raises
:class:`TaskError` with a single sentence that says what went wrong and what to do about it;
:class:`PluginNotAllowed`, one kind of it, says a plug-in's module was not among those the caller allowed.
"""

from peer.errors import UserError


class TaskError(UserError, ValueError):
    """A task could not be resolved, configured or used as asked; the message says how to fix it."""


class PluginNotAllowed(TaskError):
    """A plug-in task whose module the caller did not allow; nothing was imported."""

    def __init__(self, ref: str, module: str):
        super().__init__(
            f"Plug-in task {ref!r} needs module {module!r}, which is not among the modules allowed here; "
            "allow it only if you trust where the task name came from."
        )
        self.ref, self.module = ref, module
