"""The one base class for errors a user can fix; the command line prints their message without a traceback."""


class UserError(Exception):
    """Something the user (or a remote peer's data) got wrong; the message says what and what to do."""
