"""Errors that report bad input to the user (as opposed to bugs)."""


class MsdsError(Exception):
    """Bad input: a checkpoint, data file, argument or environment problem, with its fix."""
