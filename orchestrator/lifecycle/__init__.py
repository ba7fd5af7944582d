"""One run from launch to its end: the phases and the `lifecycle()` that gives each failure its meaning (`job`),
the follow loop (`follow`), the kinds of failure (`errors`), Ctrl-C that cannot be lost (`interrupt`), the live
terminal view (`display`)."""
