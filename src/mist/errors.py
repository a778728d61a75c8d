"""The one exception type for bad user input.

Anything raised as `MistInputError` reaches the user as one sentence and exit code 2
(see `mist.cli`); everything else is a bug and keeps its traceback.
"""


class MistInputError(ValueError):
    """Invalid user input: the message is one complete sentence meant for the user."""
