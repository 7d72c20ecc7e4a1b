"""The exception of bad report input."""


class ReportError(ValueError):
    """Bad report input (a date, a setting, a CSV line); the message names what and where."""
