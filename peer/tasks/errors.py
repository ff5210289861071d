"""The one exception type of the tasks package.

Every problem a user can cause (an unknown task name, a bad config, a plug-in that does not import) raises
:class:`TaskError` with a single sentence that says what went wrong and what to do about it.
"""

from peer.errors import UserError


class TaskError(UserError, ValueError):
    """A task could not be resolved, configured or used as asked; the message says how to fix it."""
