"""A completion's text, whichever of TRL's two formats it arrives in.

Hand-written (format plumbing). TRL hands a reward function its completions either as strings
(standard format) or as lists of `{"role", "content"}` messages (conversational format); every
verifier in minirl reads the text through `completion_text`, which never raises.
"""


def completion_text(completion) -> str | None:
    """The text of a completion given as a string or as TRL's list of chat messages; None otherwise."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else None
    return None
