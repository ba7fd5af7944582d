"""One run from launch to its end: the phases (`job`), the follow loop (`follow`), the one place failures are
given their meaning (`errors`), Ctrl-C that cannot be lost (`interrupt`), the live terminal view (`display`)."""
