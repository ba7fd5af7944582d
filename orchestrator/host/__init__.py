"""Where the worker runs: the `Transport` interface (`transport`), this machine (`local`) and SSH hosts (`ssh`),
picked in one hook (`connect`); checking a host (`preflight`), copying the code (`sync`), starting, watching
and stopping the worker there (`launch`)."""
