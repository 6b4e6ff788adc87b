"""Errors a user can cause. The CLI prints them as one line and exits non-zero; anything else is a bug."""


class UserError(Exception):
    """Bad input: a path, a checkpoint, a bundle, a flag. The message is the whole story, one line."""


class BundleError(UserError):
    """A bundle that is corrupted, tampered with, or from an unknown format version."""
