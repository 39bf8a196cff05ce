class UserError(ValueError):
    """A mistake in what the user asked for: one line, exit code 2."""
