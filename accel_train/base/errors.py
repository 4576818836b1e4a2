"""The one exception type that means "the user asked for something we cannot do".

The CLI turns it into a single line on stderr and exit code 2; anything else is a bug and keeps
its traceback.  It subclasses ValueError so library callers can catch it the usual way.
"""

import difflib
import faulthandler
import signal


class UsageError(ValueError):
    """Bad input: the message names what is wrong and the flag or file to change."""


class RunDiffers(UsageError):
    """A resume refused because this start's options or data are not the checkpoint's run's
    (another --model, seed, image size, set of images): the command line names every option
    that differs from the run's record beside it (run/resume_options.py)."""


def first_few(words, limit: int = 5) -> str:
    """A list for a one-line message: the first `limit` words, and how many more."""
    words = list(words)
    return ", ".join(words[:limit]) + (f" and {len(words) - limit} more"
                                       if len(words) > limit else "")


def did_you_mean(word: str, known) -> str:
    """"did you mean A, B? " for up to three of `known` close to `word` (difflib's ratio at
    least 0.6), or "" where none is: the hint a one-line message gives for a misspelt name."""
    close = difflib.get_close_matches(word, list(known), n=3, cutoff=0.6)
    return f"did you mean {', '.join(close)}? " if close else ""


def first_line(err: BaseException, limit: int = 160) -> str:
    """A library error's first line (its type's name if it has no text), cut to `limit`
    characters: the reason inside one of our one-line messages."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]


class RunStopped(Exception):
    """A runtime failure that is not bad input (the disk filled up while a checkpoint was
    written): the CLI prints the message as one line and exits with `exit_code`, without a
    traceback.  Anything not foreseen stays a traceback."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# sysexits.h's EX_IOERR ("an error occurred while doing I/O on some file"): neither bad input (2)
# nor a stop by signal (143, 130), nor Python's 1 for a traceback.
DISK_FULL_EXIT = 74
# sysexits.h's EX_TEMPFAIL ("a temporary failure; the user is invited to retry"): a rank or a
# loader worker stalled; the elastic launcher restarts the group from the newest checkpoint.
STALLED_EXIT = 75
# sysexits.h's EX_DATAERR ("the input data was incorrect in some way"): the run's own numbers
# went bad (the weights are NaN or infinite, divergence.py), which the settings can fix.
DIVERGED_EXIT = 65


STACKS_SIGNAL = getattr(signal, "SIGUSR1", None)  # None on Windows: no such signal


def stacks_on_request() -> None:
    """`kill -USR1 PID` makes the process write every thread's Python stack to its stderr (under
    a launcher, the launcher's output) and go on: where a run that hangs sits, without a
    debugger.  Loader workers register it too when they start (worker_start.init_worker), so a
    worker stuck anywhere, not only in a read that loader_watch.py names, can be asked the same."""
    if STACKS_SIGNAL is None:
        return
    # The descriptor, not sys.stderr: a caller that replaced sys.stderr (pytest's capture, a
    # notebook) has no file descriptor behind it, and faulthandler writes from a signal handler.
    faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True, chain=False)
